"""The trainer side of gated rollouts: a concurrent driver and a record -> sample builder.

:func:`run_rollouts` drives N gated sessions of one :class:`~harnesses.session.AgentSessionFactory`
at once (at most ``concurrency`` alive at a time). Every model call a harness makes is
answered by ``generate``, the trainer's own function::

    async def generate(rollout_id, turn, messages, tools, sampling) -> str | Completion: ...

A plain string is the assistant's text; a :class:`~harnesses.gate.Completion` may add tool
calls, usage and metadata (token ids, logprobs). :class:`OpenAIGenerator` is a ready-made
``generate`` for any OpenAI-compatible endpoint (vLLM, SGLang, a provider): it asks for
logprobs and vLLM's token ids and keeps them as the completion's metadata.

:func:`build_sample` turns a :class:`~harnesses.session.RolloutRecord` into a
:class:`TrainingSample`: the conversation with the delivered assistant messages marked,
and, when every delivered turn carries token ids, one token sequence with its logprobs and
the loss mask (prompt and tool-output tokens 0, delivered completion tokens 1)::

    async with AgentSessionFactory(runtime, {"id": "bash"}, verify=verifier) as factory:
        async with OpenAIGenerator(vllm_endpoint) as generate:
            results = await run_rollouts(factory, tasks, generate, concurrency=8)
    samples = [build_sample(r.record) for r in results if r.ok]
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from runtimes import SandboxError

from .errors import (
    ModelResponseError,
    SampleError,
    SessionClosedError,
    SessionError,
    SessionGenerateError,
    SessionProtocolError,
)
from .gate import Completion
from .llm import ChatClient, Message, ModelEndpoint, parse_chat_completion
from .session import AgentSession, AgentSessionFactory, RolloutRecord, Verification

__all__ = [
    "GenerateFn",
    "OpenAIGenerator",
    "RolloutResult",
    "RolloutTask",
    "TrainingSample",
    "answer_requests",
    "build_sample",
    "completion_from_response",
    "run_rollouts",
]

log = logging.getLogger("harnesses.trainer")

GenerateFn = Callable[
    [str, int, list[Message], list[dict[str, Any]] | None, dict[str, Any]],
    Awaitable[Completion | str | Mapping[str, Any]],
]
"""``async generate(rollout_id, turn, messages, tools, sampling)``: one assistant turn, as
text, a :class:`Completion` or a dict of its fields."""

PROMPT_IDS = "prompt_token_ids"
TOKEN_IDS = "token_ids"
LOGPROBS = "logprobs"
_TOKEN_ID = re.compile(r"^token_id:(\d+)$")


# ---------------------------------------------------------------------- generate over HTTP


def completion_from_response(data: Any) -> Completion:
    """A :class:`Completion` from a chat-completions answer, keeping what a trainer needs.

    ``metadata`` gets ``prompt_token_ids`` (vLLM's top-level field), ``token_ids`` (the
    choice's, or the ids of ``logprobs`` tokens rendered ``token_id:N``) and ``logprobs``
    (one float per generated token), each only when the answer has it. ``usage`` is kept
    when the answer reports one.

    Raises:
        ModelResponseError: not a chat completion, or one with neither text nor tool calls.
    """
    reply = parse_chat_completion(data)
    choice = data["choices"][0]
    metadata: dict[str, Any] = {}
    prompt_ids = _int_list(data.get(PROMPT_IDS, choice.get(PROMPT_IDS)))
    if prompt_ids is not None:
        metadata[PROMPT_IDS] = prompt_ids
    entries = _logprob_entries(choice.get(LOGPROBS))
    token_ids = _int_list(choice.get(TOKEN_IDS))
    if token_ids is None and entries:
        token_ids = _ids_from_logprobs(entries)
    if token_ids is not None:
        metadata[TOKEN_IDS] = token_ids
    if entries:
        metadata[LOGPROBS] = [float(e["logprob"]) for e in entries]
    usage = reply.usage if reply.usage.total_tokens else None
    try:
        return Completion(
            content=reply.content,
            tool_calls=reply.tool_calls,
            usage=usage,
            finish_reason=reply.finish_reason,
            metadata=metadata,
        )
    except ValidationError as exc:
        raise ModelResponseError(f"the completion is empty: {exc.errors()[0]['msg']}") from None


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    return None


def _logprob_entries(value: Any) -> list[Mapping[str, Any]]:
    content = value.get("content") if isinstance(value, Mapping) else None
    if not isinstance(content, list):
        return []
    entries = [e for e in content if isinstance(e, Mapping)]
    if len(entries) != len(content) or not all(
        isinstance(e.get("logprob"), int | float) for e in entries
    ):
        raise ModelResponseError("choices[0].logprobs.content has an entry without a logprob")
    return entries


def _ids_from_logprobs(entries: Sequence[Mapping[str, Any]]) -> list[int] | None:
    matches = [_TOKEN_ID.match(str(e.get("token", ""))) for e in entries]
    if not all(matches):
        return None
    return [int(m.group(1)) for m in matches if m is not None]


class OpenAIGenerator:
    """A ``generate`` function over an OpenAI-compatible chat-completions endpoint.

    Each call posts the harness's messages and tools with the endpoint's ``sampling``,
    then the call's ``sampling`` on top, plus ``logprobs: true`` (when ``logprobs``) and
    vLLM's ``return_token_ids: true`` (when ``token_ids``; turn it off for a provider that
    refuses unknown fields). Use it as an async context manager (it owns an HTTP pool).

    Raises (from a call):
        ModelHTTPError / ModelTimeoutError / ModelConnectionError / ModelResponseError: the
            endpoint failed (after the endpoint's retries).
    """

    def __init__(
        self,
        endpoint: ModelEndpoint,
        *,
        logprobs: bool = True,
        token_ids: bool = True,
        http_client: httpx.AsyncClient | None = None,
    ):
        """Raises ModelConfigError: the endpoint's key variable is not set."""
        self.endpoint = endpoint
        self._extra: dict[str, Any] = {}
        if logprobs:
            self._extra["logprobs"] = True
        if token_ids:
            self._extra["return_token_ids"] = True
        self._client = ChatClient(endpoint, http_client=http_client)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP pool (when this generator made it)."""
        await self._client.aclose()

    async def __call__(
        self,
        rollout_id: str,
        turn: int,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        sampling: dict[str, Any],
    ) -> Completion:
        """One assistant turn for ``rollout_id`` (see the class doc for the errors)."""
        body = self._client.request_body(messages, tools)
        reserved = {"model", "messages", "tools", "stream", "n"}
        body.update({k: v for k, v in sampling.items() if k not in reserved})
        body.update(self._extra)
        data, _ = await self._client.post(body)
        return completion_from_response(data)


# ---------------------------------------------------------------------- the driver


class RolloutTask(BaseModel):
    """One rollout to run: its id and its task (a prompt or a mapping with ``prompt``)."""

    model_config = ConfigDict(frozen=True)

    rollout_id: str
    task: str | dict[str, Any]


class RolloutResult(BaseModel):
    """How one rollout of :func:`run_rollouts` ended.

    ``record`` is the session's record after it closed (reward, turns, trace with the
    judges' runs). ``error`` is the typed failure's message (``error_type`` its class), also
    for a rollout whose session never started (``record`` is then ``None``).
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    rollout_id: str
    record: RolloutRecord | None = None
    verification: Verification | None = None
    error: str | None = None
    error_type: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.record is not None


async def run_rollouts(
    factory: AgentSessionFactory,
    tasks: Sequence[RolloutTask | tuple[str, str | Mapping[str, Any]]],
    generate: GenerateFn,
    *,
    concurrency: int = 8,
    sampling: Mapping[str, Any] | None = None,
    request_timeout: float | None = None,
) -> list[RolloutResult]:
    """Run every task as a gated rollout, answering each model call with ``generate``.

    At most ``concurrency`` sessions (sandboxes) are alive at once. Each rollout: create
    the session, answer ``next_request()`` with ``generate(rollout_id, turn, messages,
    tools, sampling)`` until the agent exits, ``verify()`` when the factory has a verify
    function, keep ``record()``, ``close()``. ``sampling`` is the request's own parameters
    (``params``) overridden by this argument's. One rollout failing (a
    :class:`~harnesses.errors.SessionError`, including ``generate`` failing:
    :class:`~harnesses.errors.SessionGenerateError`) is recorded on its result and does
    not stop the others. Results come back in the order of ``tasks``.

    Raises:
        SessionProtocolError: ``concurrency`` below 1, or two tasks with one rollout id.
        SessionClosedError: the factory is not open.
    """
    if concurrency < 1:
        raise SessionProtocolError(f"concurrency must be >= 1, got {concurrency}")
    jobs = [_job(task) for task in tasks]
    ids = [job.rollout_id for job in jobs]
    if len(set(ids)) != len(ids):
        raise SessionProtocolError(f"rollout ids must be unique, got {ids}")
    results: list[RolloutResult | None] = [None] * len(jobs)
    limiter = anyio.Semaphore(concurrency)
    driver = _Driver(factory, generate, dict(sampling or {}), request_timeout)

    async def one(index: int, job: RolloutTask) -> None:
        async with limiter:
            results[index] = await driver.rollout(job)

    async with anyio.create_task_group() as group:
        for index, job in enumerate(jobs):
            group.start_soon(one, index, job)
    return [r for r in results if r is not None]


def _job(task: RolloutTask | tuple[str, str | Mapping[str, Any]]) -> RolloutTask:
    if isinstance(task, RolloutTask):
        return task
    rollout_id, spec = task
    return RolloutTask(rollout_id=rollout_id, task=spec if isinstance(spec, str) else dict(spec))


class _Driver:
    def __init__(
        self,
        factory: AgentSessionFactory,
        generate: GenerateFn,
        sampling: dict[str, Any],
        request_timeout: float | None,
    ):
        self._factory = factory
        self._generate = generate
        self._sampling = sampling
        self._timeout = request_timeout

    async def rollout(self, job: RolloutTask) -> RolloutResult:
        """One rollout start to end; a :class:`SessionError` ends up on the result.

        Raises:
            SessionClosedError: the factory is not open.
        """
        result = RolloutResult(rollout_id=job.rollout_id)
        try:
            session = await self._factory.create(task=job.task, rollout_id=job.rollout_id)
        except SessionClosedError:
            raise
        except SessionError as exc:
            _fail(result, exc)
            return result
        try:
            await self._answer_all(session)
            if self._factory.has_verify:
                result.verification = await session.verify()
        except SessionError as exc:
            _fail(result, exc)
        finally:
            try:
                await session.close()
            except SandboxError as exc:  # the sandbox's removal is unconfirmed: say so
                if result.error is None:
                    _fail(result, exc)
            result.record = session.record()
        return result

    async def _answer_all(self, session: AgentSession) -> None:
        await answer_requests(session, self._generate, self._sampling, self._timeout)


async def answer_requests(
    session: AgentSession,
    generate: GenerateFn,
    sampling: Mapping[str, Any] | None = None,
    request_timeout: float | None = None,
) -> None:
    """Answer every model call of ``session`` with ``generate`` until its agent exits: what
    :func:`run_rollouts` does for each rollout, and what a loop-owning adapter runs on its own.
    ``sampling`` overrides each request's own ``params``.

    Raises:
        SessionGenerateError: ``generate`` failed (the cause chained).
        What :meth:`AgentSession.next_request` / :meth:`AgentSession.deliver` raise.
    """
    overrides = dict(sampling or {})
    while (request := await session.next_request(request_timeout)) is not None:
        try:
            completion = await generate(
                session.rollout_id,
                request.turn,
                request.messages,
                request.tools,
                {**request.params, **overrides},
            )
        except Exception as exc:  # the trainer's own function: any failure fails this rollout
            raise SessionGenerateError(
                f"generate failed for turn {request.turn}: {exc}", rollout_id=session.rollout_id
            ) from exc
        await session.deliver(request, completion)


def _fail(result: RolloutResult, exc: SessionError | SandboxError) -> None:
    log.info("rollout %r failed: %s", result.rollout_id, exc)
    result.error = str(exc)
    result.error_type = type(exc).__name__


# ---------------------------------------------------------------------- samples


class TrainingSample(BaseModel):
    """One rollout as a trainer consumes it.

    Message level (always): ``messages`` (:attr:`RolloutRecord.messages`) and
    ``message_mask`` (1 on the assistant messages the trainer delivered).

    Token level (when every delivered turn's metadata has ``prompt_token_ids`` and
    ``token_ids``, as :class:`OpenAIGenerator` keeps them from vLLM): ``token_ids`` is the
    first turn's prompt, then each turn's completion and the new prompt tokens before the
    next turn (tool outputs, the chat template's glue); ``loss_mask`` is 1 on delivered
    completion tokens and 0 on every prompt token; ``logprobs`` is the sampler's logprob
    per token (0.0 where the mask is 0), or ``None`` when a turn came without them.
    """

    rollout_id: str
    reward: float | None
    status: str
    messages: list[Message]
    message_mask: list[int]
    token_ids: list[int] | None = None
    loss_mask: list[int] | None = None
    logprobs: list[float] | None = None
    turns: int = Field(description="how many delivered turns the sample covers")


def build_sample(record: RolloutRecord) -> TrainingSample:
    """The :class:`TrainingSample` of a rollout record (see its doc).

    Raises:
        SampleError: the record is not linear (the harness rewrote its history, so one
            message sequence does not hold every turn), or the turns carry token ids but a
            turn's prompt tokens do not extend the tokens before it. Build one sample per
            turn from ``record.turns[i].completion.metadata`` then.
    """
    if record.turns and not record.linear:
        raise SampleError(
            f"rollout {record.rollout_id!r} is not linear: its turns are not one conversation"
        )
    sample = TrainingSample(
        rollout_id=record.rollout_id,
        reward=record.reward,
        status=record.status,
        messages=record.messages,
        message_mask=[int(flag) for flag in record.delivered_mask()],
        turns=len(record.turns),
    )
    metadata = [turn.completion.metadata for turn in record.turns]
    if metadata and all(
        _int_list(m.get(PROMPT_IDS)) and _int_list(m.get(TOKEN_IDS)) for m in metadata
    ):
        _add_tokens(sample, record.rollout_id, metadata)
    return sample


def _add_tokens(sample: TrainingSample, rollout_id: str, turns: list[dict[str, Any]]) -> None:
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] | None = []
    for index, meta in enumerate(turns):
        prompt: list[int] = meta[PROMPT_IDS]
        generated: list[int] = meta[TOKEN_IDS]
        if prompt[: len(tokens)] != tokens:
            raise SampleError(
                f"rollout {rollout_id!r}: the prompt tokens of turn {index} do not extend "
                f"the {len(tokens)} tokens before it"
            )
        fresh = prompt[len(tokens) :]
        tokens += fresh + generated
        mask += [0] * len(fresh) + [1] * len(generated)
        turn_logprobs = meta.get(LOGPROBS)
        if (
            logprobs is not None
            and isinstance(turn_logprobs, list)
            and len(turn_logprobs) == len(generated)
        ):
            logprobs += [0.0] * len(fresh) + [float(v) for v in turn_logprobs]
        else:
            logprobs = None
    sample.token_ids, sample.loss_mask, sample.logprobs = tokens, mask, logprobs
