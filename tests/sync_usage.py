"""Code the type checker verifies (``tests/test_sync_faces.py`` runs mypy on it; nothing
runs it): the blocking facades are typed as their async API is."""

from __future__ import annotations

from harnesses.gate import InterceptedRequest
from harnesses.rollout import RolloutRecord, Verification
from harnesses.session import SyncAgentSession, SyncAgentSessionFactory
from runtimes import ExecResult, FileInfo
from runtimes.lifecycle import State
from runtimes.sync import SyncHostRoute, SyncRuntime, SyncShellSession, open_runtime_sync
from runtimes.sync_faces import RuntimeFace


def use_a_runtime() -> None:
    with open_runtime_sync({"type": "subprocess"}) as rt:
        started: SyncRuntime = rt
        result: ExecResult = rt.exec(["ls"], timeout=5.0, stdin=iter([b"x"]), check=True)
        data: bytes = rt.read("a.txt", max_bytes=10)
        rt.write("b.txt", "text")
        entries: list[FileInfo] = rt.list(".", max_entries=5)
        found: bool = rt.exists("b.txt")
        where: str = rt.workdir
        state: State = rt.state
        with rt.shell(pty=False) as sh:
            session: SyncShellSession = sh
            ran: ExecResult = sh.run("cd src && make", timeout=3.0)
            sh.resize(40, 100)
        with rt.expose_host(8000) as route:
            routed: SyncHostRoute = route
            url: str = route.url("/v1")
        del started, result, data, entries, found, where, state, session, ran, routed, url


def take_a_face(rt: RuntimeFace) -> bytes:
    return rt.read("a.txt")


def fake_or_not(rt: SyncRuntime) -> bytes:
    return take_a_face(rt)


def use_a_factory() -> None:
    with SyncAgentSessionFactory("subprocess", "null") as factory:
        session: SyncAgentSession = factory.create(task="hi", rollout_id="r-0")
        request: InterceptedRequest | None = session.next_request(timeout=5.0)
        if request is not None:
            session.deliver(request, "done")
        verdict: Verification = session.verify()
        record: RolloutRecord = session.record()
        session.close()
        del verdict, record
