"""Conformance checks run as `nobody`: the ones a root sandbox skips, played for real."""

from __future__ import annotations

import json
import os
import pwd
from collections.abc import Iterable
from typing import Any

from runtimes.registry import available_runtimes
from runtimes.testing import run_conformance


def conformance_as_nobody(config: Any, select: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Run the ``select``ed checks against ``config`` in a forked child that dropped to
    `nobody` (the caller is root); returns name -> (status, detail)."""
    # The interpreter may live where `nobody` cannot read (/root/.pyenv): import in the
    # parent what resolving a runtime imports lazily, before the child drops privileges.
    available_runtimes()
    nobody = pwd.getpwnam("nobody")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, run the checks, report as JSON
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            outcomes = run_conformance(config, select=list(select))
            payload = json.dumps([[o.name, o.status, o.detail] for o in outcomes]).encode()
            os.write(write_end, payload)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return {name: (status, detail) for name, status, detail in json.loads(data)}
