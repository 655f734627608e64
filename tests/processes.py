"""Seeing a sandbox's processes from the outside: every container shares this kernel, so
``pgrep`` on the host sees what runs in all of them (the tests run as root)."""

from __future__ import annotations

import random
import subprocess


def sleep_token() -> str:
    """A unique ``sleep`` duration: a process running it is findable by its command line."""
    return f"{random.randint(100, 999)}.{random.randint(10**5, 10**6 - 1)}"


def running_anywhere(token: str) -> list[str]:
    """Processes on this kernel (the host's and every container's) naming ``token``."""
    found = subprocess.run(["pgrep", "-af", token], capture_output=True, text=True, check=False)
    return [line for line in found.stdout.splitlines() if "pgrep" not in line]
