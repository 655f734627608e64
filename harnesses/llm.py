"""Model access: the model table and a small async chat-completions client.

A *model table* maps logical names (``"grader"``, ``"critic"``, ...) to OpenAI-compatible
endpoints, so endpoints never live in task code::

    models:
      grader:
        base_url: https://api.openai.com/v1
        api_key_env: OPENAI_API_KEY      # the NAME of the variable, never the key
        model: gpt-4o-mini
        sampling: {temperature: 0, max_tokens: 1024}

``"policy"`` is reserved: it is the rollout's own model, which the caller supplies per
rollout (``table.resolve("policy", policy=endpoint)``); a table that defines it is refused.

:class:`ChatClient` posts to ``{base_url}/chat/completions`` with httpx and returns a
:class:`ChatReply` (content, tool calls, usage, latency). Failures are typed
(:mod:`harnesses.errors`): ``ModelHTTPError(status_code, body)``, ``ModelTimeoutError``,
``ModelConnectionError``, ``ModelResponseError``. The API key is read from the
environment when the client is built and appears in no repr, log line or error.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import anyio
import httpx
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from .errors import (
    ModelConfigError,
    ModelConnectionError,
    ModelHTTPError,
    ModelResponseError,
    ModelTimeoutError,
    UnknownModelError,
)

__all__ = [
    "POLICY",
    "RETRYABLE_STATUSES",
    "ChatClient",
    "ChatReply",
    "Message",
    "ModelEndpoint",
    "ModelTable",
    "ToolCall",
    "Usage",
    "parse_chat_completion",
    "redact",
]

log = logging.getLogger("harnesses.llm")

POLICY = "policy"
"""The reserved logical name of the rollout's own model."""

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
"""Statuses :class:`ChatClient` retries (bounded by the endpoint's ``max_retries``)."""

Message = dict[str, Any]
"""One OpenAI chat message (``{"role": ..., "content": ...}``, plus tool fields)."""

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RESERVED_SAMPLING = frozenset({"model", "messages", "tools", "stream", "n"})


class ModelEndpoint(BaseModel):
    """One OpenAI-compatible chat-completions endpoint.

    ``base_url`` ends before ``/chat/completions`` (for example ``https://host/v1``).
    ``api_key_env`` is the NAME of the environment variable holding the key (``None``
    for endpoints that need no key); a value that does not look like a variable name is
    refused, so a key pasted there by mistake is never stored. ``sampling`` is merged
    into every request (``temperature``, ``max_tokens``, ``top_p``, ...).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    api_key_env: str | None = None
    model: str = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    timeout: float = Field(default=120.0, gt=0, description="seconds per request")
    max_retries: int = Field(
        default=2, ge=0, le=10, description="retries on connection errors and 408/429/5xx"
    )

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {value!r}")
        return value.rstrip("/")

    @field_validator("api_key_env")
    @classmethod
    def _check_api_key_env(cls, value: str | None) -> str | None:
        if value is not None and not _ENV_NAME.match(value):
            # Never echo the value: it may be a key pasted into the wrong field.
            raise ValueError(
                "api_key_env must be the NAME of an environment variable "
                "(letters, digits, underscores), not the key itself"
            )
        return value

    @field_validator("sampling")
    @classmethod
    def _check_sampling(cls, value: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(_RESERVED_SAMPLING & value.keys())
        if clash:
            raise ValueError(f"sampling may not set {clash}: the client sets them")
        return value

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}/chat/completions"

    def resolve_api_key(self) -> str | None:
        """The key from ``api_key_env`` (``None`` when the endpoint needs none).

        Raises:
            ModelConfigError: ``api_key_env`` names a variable that is not set.
        """
        if self.api_key_env is None:
            return None
        key = os.environ.get(self.api_key_env)
        if not key:
            raise ModelConfigError(
                f"environment variable {self.api_key_env} (API key for model {self.model!r} "
                f"at {self.base_url}) is not set"
            )
        return key


class ModelTable(BaseModel):
    """Logical model names mapped to endpoints. ``"policy"`` is reserved (see module doc)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[str, ModelEndpoint] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _refuse_policy(self) -> Self:
        if POLICY in self.models:
            raise ValueError(
                f"{POLICY!r} is reserved for the rollout's own model: pass it per rollout "
                f"(ModelTable.resolve('policy', policy=endpoint)), not in the table"
            )
        return self

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelTable:
        """A table from ``{"models": {name: endpoint-fields, ...}}``.

        Raises:
            ModelConfigError: invalid fields (each named), or ``policy`` defined.
        """
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            raise ModelConfigError(_describe_validation("model table", exc)) from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> ModelTable:
        """A table from a ``.yaml``/``.yml`` or ``.json`` file.

        Raises:
            ModelConfigError: unreadable file, a syntax error, or invalid fields.
        """
        source = Path(path)
        try:
            text = source.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelConfigError(f"cannot read model table {source}: {exc}") from exc
        try:
            data = json.loads(text) if source.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, RecursionError, yaml.YAMLError) as exc:
            raise ModelConfigError(f"model table {source} is not valid: {exc}") from exc
        if not isinstance(data, Mapping):
            raise ModelConfigError(f"model table {source} must be a mapping with a 'models' key")
        return cls.from_dict(data)

    def names(self) -> list[str]:
        return sorted(self.models)

    def resolve(self, name: str, *, policy: ModelEndpoint | None = None) -> ModelEndpoint:
        """The endpoint for a logical name; ``"policy"`` comes from the ``policy`` argument.

        Raises:
            UnknownModelError: no such name (the message lists the known ones), or
                ``"policy"`` asked for without a ``policy`` endpoint.
        """
        if name == POLICY:
            if policy is None:
                raise UnknownModelError(
                    "the 'policy' model is supplied per rollout; none was given"
                )
            return policy
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(self.names()) or "none"
            raise UnknownModelError(f"no model named {name!r} (known: {known})") from None


class Usage(BaseModel):
    """Token counts of one completion (or a sum of several)."""

    model_config = ConfigDict(extra="ignore")

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            total_tokens=self.total_tokens + other.total_tokens,
        )


class ToolCall(BaseModel):
    """One function call the model asked for. ``arguments`` is the raw JSON text."""

    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> dict[str, Any]:
        """The arguments as a dict.

        Raises:
            ValueError: not JSON, or not a JSON object.
        """
        value = json.loads(self.arguments or "{}")
        if not isinstance(value, dict):
            raise ValueError(f"tool arguments must be a JSON object, got {type(value).__name__}")
        return value


class ChatReply(BaseModel):
    """What one chat completion returned."""

    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    usage: Usage = Field(default_factory=Usage)
    latency: float = 0.0
    finish_reason: str | None = None
    model: str | None = None
    reasoning: str | None = None
    """The model's reasoning text where a recorded conversation carried one (an assistant
    message's ``reasoning_content`` or ``reasoning``): shown to judges in the transcript,
    never sent back to an endpoint."""

    def assistant_message(self) -> Message:
        """The reply as the assistant message to append to the conversation."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in self.tool_calls
            ]
        return message


def parse_chat_completion(data: Any, *, latency: float = 0.0) -> ChatReply:
    """A :class:`ChatReply` from a decoded chat-completions response body.

    Raises:
        ModelResponseError: the body is not a chat completion with a first choice.
    """
    if not isinstance(data, Mapping):
        raise ModelResponseError(f"response is a {type(data).__name__}, not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
        raise ModelResponseError("response has no choices")
    message = choices[0].get("message")
    if not isinstance(message, Mapping):
        raise ModelResponseError("first choice has no message")
    return ChatReply(
        content=_message_text(message.get("content")),
        tool_calls=_tool_calls(message.get("tool_calls")),
        usage=_usage(data.get("usage")),
        latency=latency,
        finish_reason=_optional_str(choices[0].get("finish_reason")),
        model=_optional_str(data.get("model")),
    )


def _message_text(content: Any) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, Mapping)]
        return "".join(str(p) for p in parts)
    raise ModelResponseError(f"message content is a {type(content).__name__}")


def _tool_calls(raw: Any) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ModelResponseError("tool_calls is not a list")
    calls = []
    for index, item in enumerate(raw):
        function = item.get("function") if isinstance(item, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ModelResponseError(f"tool_calls[{index}] has no function name")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments)
        if not isinstance(arguments, str):
            raise ModelResponseError(f"tool_calls[{index}].function.arguments is not a string")
        call_id = item.get("id") or f"call_{index}"
        calls.append(ToolCall(id=str(call_id), name=function["name"], arguments=arguments))
    return calls


def _usage(raw: Any) -> Usage:
    if not isinstance(raw, Mapping):
        return Usage()
    try:
        usage = Usage.model_validate(
            {k: raw.get(k) or 0 for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        )
    except ValidationError as exc:
        raise ModelResponseError(f"malformed usage: {exc}") from None
    if not usage.total_tokens:
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return usage


def _optional_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _describe_validation(what: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return f"invalid {what}:\n" + "\n".join(lines)


def redact(text: str, secret: str | None) -> str:
    """``text`` with every occurrence of ``secret`` replaced (providers echo keys in 401s)."""
    if secret and len(secret) >= 4:
        return text.replace(secret, "***")
    return text


def _is_retryable(exc: BaseException) -> bool:
    if isinstance(exc, ModelConnectionError):
        return True
    return isinstance(exc, ModelHTTPError) and exc.status_code in RETRYABLE_STATUSES


class ChatClient:
    """An async client for one endpoint: ``async with ChatClient(ep) as c: await c.chat(...)``.

    Retries connection failures and 408/429/5xx answers up to ``endpoint.max_retries``
    times with exponential backoff (tenacity, sleeping through anyio so it works under
    asyncio and trio). Cancelling the awaiting task aborts the request.
    """

    def __init__(
        self,
        endpoint: ModelEndpoint,
        *,
        api_key: str | None = None,
        http_client: httpx.AsyncClient | None = None,
    ):
        """Build a client; the key comes from ``api_key`` or the endpoint's ``api_key_env``.

        Raises:
            ModelConfigError: the endpoint's key variable is not set.
        """
        self.endpoint = endpoint
        self._api_key = api_key if api_key is not None else endpoint.resolve_api_key()
        self._owns_http = http_client is None
        self._http = http_client or httpx.AsyncClient(timeout=httpx.Timeout(endpoint.timeout))

    def __repr__(self) -> str:
        key = "set" if self._api_key else "none"
        return (
            f"ChatClient(model={self.endpoint.model!r}, "
            f"base_url={self.endpoint.base_url!r}, api_key={key})"
        )

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
        """Close the HTTP connection pool (when this client created it)."""
        if self._owns_http:
            await self._http.aclose()

    def request_body(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> dict[str, Any]:
        """The JSON body :meth:`chat` sends: model, messages, sampling, tools."""
        body: dict[str, Any] = {"model": self.endpoint.model, "messages": list(messages)}
        body.update(self.endpoint.sampling)
        if tools:
            body["tools"] = list(tools)
        return body

    async def chat(
        self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> ChatReply:
        """One chat completion.

        Args:
            messages: the conversation so far (OpenAI message dicts).
            tools: OpenAI function tools the model may call.

        Returns:
            The first choice's content and tool calls, the usage, and the latency in
            seconds (including retries).

        Raises:
            ModelHTTPError: a non-2xx answer (after retries for 408/429/5xx).
            ModelTimeoutError: no answer within ``endpoint.timeout``.
            ModelConnectionError: the endpoint could not be reached (after retries).
            ModelResponseError: a 2xx answer that is not a chat completion.
        """
        data, latency = await self.post(self.request_body(messages, tools))
        return parse_chat_completion(data, latency=latency)

    async def post(self, body: Mapping[str, Any]) -> tuple[Any, float]:
        """POST ``body`` as is to the chat-completions URL, with :meth:`chat`'s retries.

        For callers that need the whole answer (token ids, logprobs, provider fields)
        rather than a :class:`ChatReply`; build ``body`` with :meth:`request_body`.

        Returns:
            The decoded JSON answer and the seconds it took (including retries).

        Raises:
            ModelHTTPError / ModelTimeoutError / ModelConnectionError: as :meth:`chat`.
            ModelResponseError: a 2xx answer that is not JSON.
        """
        started = time.monotonic()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.endpoint.max_retries + 1),
            wait=wait_exponential(multiplier=0.5, max=8),
            retry=retry_if_exception(_is_retryable),
            sleep=anyio.sleep,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                data = await self._post(dict(body))
        return data, time.monotonic() - started

    async def _post(self, body: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        url = self.endpoint.chat_url
        try:
            response = await self._http.post(url, json=body, headers=headers)
        except httpx.TimeoutException as exc:
            raise ModelTimeoutError(
                f"model {self.endpoint.model!r} at {url} did not answer within "
                f"{self.endpoint.timeout}s"
            ) from exc
        except httpx.TransportError as exc:
            raise ModelConnectionError(
                f"cannot reach model endpoint {url}: {type(exc).__name__}: {exc}"
            ) from exc
        text = redact(response.text, self._api_key)
        if not response.is_success:
            log.debug("model %s answered HTTP %s", url, response.status_code)
            raise ModelHTTPError(response.status_code, text, url=url)
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelResponseError(
                f"model endpoint {url} answered with invalid JSON: {exc}"
            ) from None
