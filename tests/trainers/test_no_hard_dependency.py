"""``import runtimes, harnesses, placement`` (and the trainer modules that need only the core
dependencies, the ray runtime's package and the CLI's listing) imports none of the trainer or
cluster extras: they stay optional."""

from __future__ import annotations

import subprocess
import sys

HEAVY = ("trl", "openenv", "torch", "transformers", "datasets", "ray")
CODE = (
    "import runtimes, harnesses, placement, placement.trainers.tools, "
    "placement.trainers.grading, placement.trainers.host, placement.trainers.generation, "
    "runtimes.ray, runtimes.ray.cluster, runtimes.cli.sandboxes, runtimes.cli.doctor; "
    "import sys; "
    f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
)


def test_core_imports_no_trainer_extra() -> None:
    result = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout
