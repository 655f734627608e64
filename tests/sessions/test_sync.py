"""The synchronous wrapper: the same contract from plain threads, the loop in a portal."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harnesses.errors import SessionClosedError, SessionDeliveryTimeout
from harnesses.llm import ModelTable
from harnesses.scripted import ScriptedEndpoint, bash_call, reply
from harnesses.session import SyncAgentSessionFactory
from placement.verifier import JudgeVerifier
from runtimes import live_runtimes

from .conftest import ScriptedTrainer, bash, host_processes, wait_for_no_extra_threads
from .test_end_to_end import CHECK_FILE, TASK, file_judge


@pytest.fixture
def grader() -> Iterator[ScriptedEndpoint]:
    with ScriptedEndpoint([bash_call(CHECK_FILE), reply("verdict written")]) as server:
        yield server
    assert server.failures == []


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_sync_session_end_to_end(grader: ScriptedEndpoint, unique: Any, loop: str) -> None:
    threads = {t.ident for t in threading.enumerate()}
    verify = JudgeVerifier([file_judge()], models=ModelTable(models={"grader": grader.endpoint()}))
    trainer = ScriptedTrainer([bash("printf hello > hello.txt"), "done"])
    with SyncAgentSessionFactory("subprocess", {"id": "bash"}, verify=verify, backend=loop) as f:
        with f.create(task=TASK, rollout_id=unique("sync")) as session:
            trainer.drive_sync(session)
            verification = session.verify()
            record = session.record()
        with pytest.raises(SessionClosedError):
            session.next_request()
    assert verification.reward == 1.0 and record.reward == 1.0
    assert record.trace is not None and record.trace.output == "done"
    assert [r.messages for r in trainer.requests] == [
        t.request_messages for t in record.trace.turns
    ]
    assert record.messages[-1] == {"role": "assistant", "content": "done"}
    assert record.linear and len(record.turns) == 2
    assert live_runtimes() == []
    wait_for_no_extra_threads(threads)  # the portal's loop thread is gone too
    with pytest.raises(SessionClosedError):
        session.deliver("req-x", "late")


def test_sync_errors_keep_their_types(unique: Any) -> None:
    threads = {t.ident for t in threading.enumerate()}
    with SyncAgentSessionFactory(
        "subprocess", {"id": "bash"}, delivery_timeout=0.5, stop_grace=10
    ) as factory:
        session = factory.create(task="sleep then talk", rollout_id=unique("synclate"))
        request = session.next_request(timeout=60)
        assert request is not None
        time.sleep(1.0)  # a trainer stuck in generation
        with pytest.raises(SessionDeliveryTimeout):
            session.deliver(request, bash("sleep 31341"))
        assert host_processes("sleep 31341") == []
    wait_for_no_extra_threads(threads)
    with pytest.raises(SessionClosedError):
        factory.create(task="t", rollout_id=unique("after"))
