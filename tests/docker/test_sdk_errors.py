"""The docker SDK's exceptions read by the one table (:mod:`runtimes.docker.sdk_errors`), and
the engine's frame demultiplexer (:func:`runtimes.docker.stream.take_frames`): no engine
needed."""

from __future__ import annotations

import docker.errors
import pytest
import requests
import requests.exceptions

from runtimes.docker.sdk_errors import Refusal, engine_answers, refused, sdk_errors
from runtimes.docker.stream import take_frames
from runtimes.errors import (
    ProvisioningError,
    SandboxError,
    SandboxInvalidArgumentError,
    SandboxTransportError,
    SandboxUnavailableError,
)

ENGINE = "the test engine"


def _api_error(status: int, explanation: str) -> docker.errors.APIError:
    response = requests.Response()
    response.status_code = status
    return docker.errors.APIError("refused", response=response, explanation=explanation)


def test_silence_is_a_transport_error() -> None:
    with (
        pytest.raises(SandboxTransportError, match="the test engine did not answer"),
        sdk_errors(ENGINE),
    ):
        raise requests.exceptions.ConnectionError("connection refused")


def test_a_handshake_failure_wrapped_by_the_sdk_is_silence_too() -> None:
    with pytest.raises(SandboxTransportError), sdk_errors(ENGINE):
        try:
            raise ConnectionResetError("reset")
        except ConnectionResetError as exc:
            raise docker.errors.DockerException("Error while fetching server API") from exc


def test_text_the_engine_cannot_carry_is_an_invalid_argument() -> None:
    with pytest.raises(SandboxInvalidArgumentError, match="valid UTF-8"), sdk_errors(ENGINE):
        "\udcff".encode()


def test_an_answer_without_a_refusal_passes_through() -> None:
    with pytest.raises(docker.errors.APIError), sdk_errors(ENGINE):
        raise _api_error(500, "boom")


def test_a_gone_container_reads_as_unavailable_when_the_call_names_it() -> None:
    refusal = refused("the engine refused it", subject="docker sandbox x")
    with (
        pytest.raises(SandboxUnavailableError, match="docker sandbox x is gone: No such"),
        sdk_errors(ENGINE, refusal),
    ):
        raise _api_error(404, "No such container: x")


def test_other_answers_read_as_the_refusals_error() -> None:
    refusal = refused("cannot inspect image 'i'", error=ProvisioningError)
    with (
        pytest.raises(ProvisioningError, match=r"^cannot inspect image 'i': boom$"),
        engine_answers(refusal),
    ):
        raise _api_error(500, "boom")
    built = Refusal(lambda message: SandboxError(f"<{message}>"))
    with (
        pytest.raises(SandboxError, match=r"^<No such container: x>$"),
        engine_answers(built),
    ):  # no subject: no "gone" reading
        raise _api_error(404, "No such container: x")


def test_frames_are_split_and_an_incomplete_one_is_kept() -> None:
    def frame(stream: int, payload: bytes) -> bytes:
        return bytes([stream, 0, 0, 0]) + len(payload).to_bytes(4, "big") + payload

    buffer = bytearray(frame(1, b"out") + frame(2, b"") + frame(2, b"err") + frame(1, b"tail"))
    buffer += b"\x01\x00"  # the start of the next header
    whole = bytes(buffer)
    assert take_frames(buffer) == [(1, b"out"), (2, b""), (2, b"err"), (1, b"tail")]
    assert bytes(buffer) == b"\x01\x00"
    buffer = bytearray(whole[:10])
    assert take_frames(buffer) == [] and bytes(buffer) == whole[:10]
