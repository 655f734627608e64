"""Run inside a fresh venv (``python -I probe.py EXTRA``, EXTRA ``base`` for none): import every
module of the three packages and use what the extra serves; print one JSON report.

It imports only the standard library and the installed project, never ``tests``: what it finds
is what a user of that venv gets.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.metadata
import json
import pkgutil
import sys
from collections.abc import Callable
from typing import Any

PACKAGES = ("runtimes", "harnesses", "placement")


def import_failures() -> dict[str, str]:
    """Every module of the packages that does not import here: module -> the missing module's
    top-level name (a ModuleNotFoundError), or the error (anything else)."""
    failures: dict[str, str] = {}
    for top in PACKAGES:
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":  # runs the CLI when imported
                continue
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as exc:
                failures[info.name] = (exc.name or repr(exc)).split(".")[0]
            except Exception as exc:  # noqa: BLE001 - reported: the test says which and why
                failures[info.name] = f"{type(exc).__name__}: {exc}"
    return failures


Served = tuple[dict[str, str], dict[str, bool]]
"""What an extra serves: the versions of the SDKs imported (by distribution), and the checks
made with them (each must be true)."""


def _docker() -> Served:
    import docker

    return {"docker": docker.__version__}, {}


def _ssh() -> Served:
    import cryptography
    import paramiko

    return {"paramiko": paramiko.__version__, "cryptography": cryptography.__version__}, {}


def _modal() -> Served:
    from runtimes.modal.client import modal_sdk  # the backend's own lazy loader

    return {"modal": modal_sdk().__version__}, {}


def _ray() -> Served:
    from runtimes.ray.calls import ray_module  # the backend's own lazy loader

    return {"ray": ray_module().__version__}, {}


def _inspect() -> Served:
    """inspect finds the ``vf`` provider through the project's entry point, and one sample's
    sandbox (the subprocess runtime) starts, runs ``true`` and is cleaned up."""
    import inspect_ai

    from runtimes.inspect_sandbox import VfSandboxEnvironment, load_config

    points = importlib.metadata.entry_points(group="inspect_ai")
    config = load_config(None)

    async def sample() -> int:
        envs = await VfSandboxEnvironment.sample_init("probe", config, {})
        try:
            return (await envs["default"].exec(["true"])).returncode
        finally:
            await VfSandboxEnvironment.sample_cleanup("probe", config, envs, False)

    return {"inspect-ai": inspect_ai.__version__}, {
        "the entry point names runtimes.inspect_sandbox": [p.value for p in points]
        == ["runtimes.inspect_sandbox"],
        "a sample's sandbox ran true": asyncio.run(sample()) == 0,
    }


def _trl() -> Served:
    """TRL and transformers import (the user's trainer calls into placement.trainers.trl with
    them), and the generator's lazy torch import takes a torch module as the model."""
    import torch
    import transformers
    import trl

    from placement.trainers.generation import TransformersGenerator

    model = torch.nn.Linear(1, 1)
    versions = {"trl": trl.__version__, "transformers": transformers.__version__}
    return {**versions, "torch": torch.__version__}, {
        "the generator takes a torch module": TransformersGenerator(model, None).model is model,
    }


def _openenv() -> Served:
    """The session factory is one of the installed OpenEnv's own (what its harness takes)."""
    from openenv.core.harness.rollout import ResourceSessionFactory

    from placement.trainers.openenv import SandboxSessionFactory

    return {"openenv": importlib.metadata.version("openenv")}, {
        "the factory is OpenEnv's": issubclass(SandboxSessionFactory, ResourceSessionFactory),
    }


SERVED: dict[str, Callable[[], Served]] = {
    "docker": _docker,
    "ssh": _ssh,
    "modal": _modal,
    "ray": _ray,
    "inspect": _inspect,
    "trl": _trl,
    "openenv": _openenv,
}


def main(extra: str) -> None:
    report: dict[str, Any] = {"import_failures": import_failures()}
    if extra in SERVED:
        versions, checks = SERVED[extra]()
        report["versions"], report["checks"] = versions, checks
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
