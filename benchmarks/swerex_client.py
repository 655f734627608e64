"""SWE-ReX's own client, driven line by line: the SWE-ReX baseline of the shell-session rows.

    <swe-rex venv>/bin/python benchmarks/swerex_client.py URL TOKEN

Runs in the separate venv that holds ``swe-rex`` (``make bench`` makes it): it imports
nothing from this project. It waits for the ``swerex-remote`` server at URL, creates a bash
session and prints ``ready``; then, for every ``run`` line read from stdin, it times one
``RemoteRuntime.run_in_session(BashAction(command="true"))`` (SWE-ReX's defaults: exit code
checked) and prints the seconds it took, so that the benchmark can interleave these calls
call by call with its own. End of stdin closes the session and exits. Any failure is printed
as ``error <message>`` and ends the program with status 1.
"""

from __future__ import annotations

import asyncio
import sys
import time


async def serve(url: str, token: str) -> None:
    from swerex.runtime.abstract import (
        BashAction,
        CloseBashSessionRequest,
        CreateBashSessionRequest,
    )
    from swerex.runtime.remote import RemoteRuntime

    runtime = RemoteRuntime(host=url, auth_token=token)
    await runtime.wait_until_alive(timeout=60)
    await runtime.create_session(CreateBashSessionRequest(startup_timeout=10))
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    while (await loop.run_in_executor(None, sys.stdin.readline)).strip() == "run":
        started = time.perf_counter()
        observation = await runtime.run_in_session(BashAction(command="true", timeout=30))
        elapsed = time.perf_counter() - started
        if observation.exit_code != 0:
            raise RuntimeError(f"`true` answered {observation!r}")
        print(f"{elapsed:.9f}", flush=True)
    await runtime.close_session(CloseBashSessionRequest())


def main() -> None:
    url, token = sys.argv[1], sys.argv[2]
    try:
        asyncio.run(serve(url, token))
    except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which shows it
        print(f"error {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
