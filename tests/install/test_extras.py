"""Each extra alone: a fresh venv holding the project's wheel with its base dependencies and
one extra (or none), in which every module of the packages imports but those that need another
extra, what the extra serves works (tests/install/probe.py), and ``vf-sandbox --help``, ``ls``
and ``doctor`` succeed, reporting each backend whose extra is missing, or that has no engine,
config or credentials here, as unavailable with its reason: never an ImportError.

One class per venv: pytest-xdist gives a class to one worker (tests/parallel.py), so the
venvs install side by side. They share the one wheel (the ``project_wheel`` fixture).
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any, ClassVar

from .venvs import REPO, TORCH_PIN, installed, json_of, make_venv, run_in

PROBE = Path(__file__).resolve().with_name("probe.py")

TOPS: dict[str, frozenset[str]] = {
    "docker": frozenset({"docker"}),
    "ssh": frozenset({"paramiko"}),
    "modal": frozenset({"modal"}),
    "inspect": frozenset({"inspect-ai"}),
    "trl": frozenset({"trl", "transformers", "torch"}),
    "openenv": frozenset({"openenv"}),
    "ray": frozenset({"ray"}),
}
"""The distributions each extra names (canonical names): a venv of one extra holds its own and
none of the others'."""
DEV_TOOLS = frozenset(
    {"pytest", "pytest-xdist", "hypothesis", "testcontainers", "trio", "ruff", "mypy", "deptry"}
)
"""The [test] extra's own tools: in none of these venvs."""
SDKS = {
    "docker": ("docker",),
    "ssh": ("paramiko", "cryptography"),
    "modal": ("modal",),
    "ray": ("ray",),
    "inspect": ("inspect-ai",),
    "trl": ("trl", "transformers", "torch"),
    "openenv": ("openenv",),
}
"""What tests/install/probe.py imports for an extra (through the backend's own lazy loader
where it has one), by distribution."""

NEEDS: dict[str, tuple[str | None, str]] = {
    "runtimes.inspect_sandbox": ("inspect", "inspect_ai"),
    "placement.trainers.openenv": ("openenv", "openenv"),
    "placement.trainers.openenv_harness": ("openenv", "openenv"),
    # pytest's plugin (the pytest11 entry point) and the conformance kit's pytest face: pytest
    # loads them, and no extra installs pytest.
    "runtimes.pytest_plugin": (None, "pytest"),
    "runtimes.testing.pytest_suite": (None, "pytest"),
}
"""The modules that import a package outside the base dependencies at import time: module ->
(the extra that installs it, the module missing without it). Every other module imports in
every venv."""

HINT = {name: f"pip install 'vf-sandbox[{name}]'" for name in ("docker", "modal", "ray", "ssh")}
"""What a backend whose extra is missing tells the user to run."""
SSH_NOWHERE = json.dumps(
    {"type": "ssh", "host": "127.0.0.1", "port": 1, "username": "probe", "password": "x"}
)
RAY_NOWHERE = json.dumps({"type": "ray", "address": "127.0.0.1:1"})
DOCTOR_TIMEOUT = "60"


def _declared_extras() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return set(project["optional-dependencies"]) - {"all", "test"}


def test_every_extra_has_a_venv_of_its_own_here() -> None:
    proven = {cls.extra for cls in _Alone.__subclasses__()} - {"base"}
    assert proven == _declared_extras() == set(TOPS)


def _rows(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in document["backends"]}


class _Alone:
    extra: ClassVar[str]
    """The extra this class's venv holds (``base``: none)."""

    def test_alone(self, project_wheel: Path, tmp_path: Path) -> None:
        extra = self.extra
        requirement = str(project_wheel) if extra == "base" else f"{project_wheel}[{extra}]"
        venv = tmp_path / "venv"
        make_venv(venv, [requirement, *([TORCH_PIN] if extra == "trl" else [])])
        found = installed(venv / "bin" / "python")
        here = self._holds_the_extra_only(found)
        self._modules_import(venv, tmp_path, here, found)
        self._cli_works(venv, tmp_path, here)
        shutil.rmtree(venv)  # up to 1.5 GB ([trl]); kept when the test fails, to look at

    def _holds_the_extra_only(self, found: dict[str, str]) -> set[str]:
        """The extras whose distributions are installed: this one's, no other's."""
        assert "vf-sandbox" in found
        assert not DEV_TOOLS & set(found), sorted(DEV_TOOLS & set(found))
        mine = TOPS.get(self.extra, frozenset())
        assert mine <= set(found), sorted(mine - set(found))
        others = {extra for extra, tops in TOPS.items() if tops & set(found)} - {self.extra}
        assert not others, f"the venv of [{self.extra}] holds the extras {sorted(others)}"
        return {self.extra} & set(TOPS)

    def _modules_import(
        self, venv: Path, tmp_path: Path, here: set[str], found: dict[str, str]
    ) -> None:
        probe = run_in(venv, ["python", "-I", str(PROBE), self.extra], tmp_path)
        assert probe.returncode == 0, probe.stderr
        report = json.loads(probe.stdout.splitlines()[-1])
        expected = {module: name for module, (extra, name) in NEEDS.items() if extra not in here}
        assert report["import_failures"] == expected
        versions = report.get("versions", {})
        # what the extra serves imports, and it is the release pip installed for it
        assert versions == {name: found[name] for name in SDKS.get(self.extra, ())}, versions
        checks = report.get("checks", {})
        assert all(checks.values()), checks

    def _cli_works(self, venv: Path, tmp_path: Path, here: set[str]) -> None:
        helped = run_in(venv, ["vf-sandbox", "--help"], tmp_path)
        assert helped.returncode == 0, helped.stderr
        assert "judge" in helped.stdout and "doctor" in helped.stdout

        listed = run_in(venv, ["vf-sandbox", "ls", "--json"], tmp_path)
        assert listed.returncode == 0, listed.stderr
        assert "Traceback" not in listed.stderr, listed.stderr
        unlisted = {entry["backend"]: entry["error"] for entry in json_of(listed)["unlisted"]}
        # no engine: docker is not listed, and says why (its SDK missing, or the engine)
        assert (HINT["docker"] in unlisted["docker"]) == ("docker" not in here), unlisted
        if "modal" in here:  # no credentials: nothing to list, Modal not contacted
            assert "modal" not in unlisted, unlisted
        else:
            assert HINT["modal"] in unlisted["modal"], unlisted

        doctor = run_in(
            venv, ["vf-sandbox", "doctor", "--json", "--timeout", DOCTOR_TIMEOUT], tmp_path
        )
        assert doctor.returncode == 0, doctor.stderr  # one backend works: subprocess
        assert "Traceback" not in doctor.stderr, doctor.stderr
        rows = _rows(json_of(doctor))
        assert set(rows) == {"docker", "modal", "ray", "ssh", "subprocess"}
        assert rows["subprocess"]["status"] == "ok", rows["subprocess"]
        for name, row in rows.items():
            assert "plugin bug" not in row["detail"], row
            if name != "subprocess":
                assert row["status"] == "unavailable", row
        for backend in ("docker", "modal"):
            assert (HINT[backend] in rows[backend]["detail"]) == (backend not in here), rows

        # ssh and ray only reach their SDKs with a config naming a host or a cluster; the ray
        # one only where Ray is missing (a Ray installed waits out the timeout for no cluster).
        targets = [SSH_NOWHERE, *([] if "ray" in here else [RAY_NOWHERE])]
        configured = run_in(
            venv,
            ["vf-sandbox", "doctor", "--json", "--timeout", DOCTOR_TIMEOUT]
            + [arg for target in targets for arg in ("--runtime", target)],
            tmp_path,
        )
        assert configured.returncode == 1, configured.stderr  # a requested backend failed
        rows = _rows(json_of(configured))
        ssh = rows["ssh"]["detail"]
        if "ssh" in here:
            assert ssh.startswith("HostUnreachableError: cannot reach 127.0.0.1:1"), ssh
        else:
            assert ssh == f"ProvisioningError: the ssh runtime needs paramiko: {HINT['ssh']}"
        if "ray" not in here:
            assert HINT["ray"] in rows["ray"]["detail"], rows["ray"]


class TestBase(_Alone):
    extra = "base"


class TestDocker(_Alone):
    extra = "docker"


class TestSsh(_Alone):
    extra = "ssh"


class TestModal(_Alone):
    extra = "modal"


class TestInspect(_Alone):
    extra = "inspect"


class TestTrl(_Alone):
    extra = "trl"


class TestOpenenv(_Alone):
    extra = "openenv"


class TestRay(_Alone):
    extra = "ray"
