"""Token-in/token-out turns from a ``transformers`` model: GRPO without an inference server.

With vLLM, :class:`~harnesses.trainer.OpenAIGenerator` answers a gated session's model calls
and keeps the engine's token ids. On a CPU (or any run without a server) the trainer's own
model answers instead: :class:`TransformersGenerator` is a ``generate`` for
:func:`~harnesses.trainer.run_rollouts` and the turn sampler of the OpenEnv adapters.

Multi-turn token ids must chain: the prompt of turn *k + 1* is exactly the prompt of turn
*k*, the ids the model sampled, then the tokens of what came between (tool output, the
template's glue). Re-rendering the whole conversation would re-tokenise the model's own
reply, and a sampled sequence is not always the tokenizer's canonical one, so a
:class:`TokenChain` renders only the new messages: it renders the conversation up to the
previous reply and up to the new generation prompt, and tokenises the difference. A chat
template that renders an earlier message differently once later ones follow (not
prefix-preserving) cannot chain: :class:`~harnesses.errors.SampleError`.

Tool calls are parsed from the reply in the Hermes / Qwen format
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``); pass ``parse=`` for another.
Arguments that are not valid JSON are passed through as text, so the harness answers them
as a tool error the policy can learn from.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

from harnesses.errors import SampleError
from harnesses.gate import Completion
from harnesses.llm import Message

__all__ = [
    "GeneratedTurn",
    "TokenChain",
    "TransformersGenerator",
    "parse_hermes_tool_calls",
]

ParsedReply = tuple[str | None, list[dict[str, Any]]]
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_hermes_tool_calls(text: str) -> ParsedReply:
    """``(content, tool_calls)`` of a reply in the Hermes / Qwen tool-call format. A block
    whose JSON has no string ``name`` stays in the content; arguments that are not a JSON
    object are kept as their raw text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    position = 0
    for match in _TOOL_CALL.finditer(text):
        body = match.group(1).strip()
        name: Any = None
        arguments: Any = None
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            name, arguments = parsed.get("name"), parsed.get("arguments", {})
        else:
            found = re.search(r'"name"\s*:\s*"([^"]+)"', body)
            name, arguments = (found.group(1), body) if found else (None, None)
        if not isinstance(name, str) or not name:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(
            {
                "name": name,
                "arguments": arguments
                if isinstance(arguments, dict | str)
                else json.dumps(arguments),
            }
        )
    kept.append(text[position:])
    content = "".join(kept).strip()
    return (content or None), calls


@dataclass
class GeneratedTurn:
    """One sampled turn: the ids it was conditioned on, the ids and logprobs sampled, the
    reply's text and what was parsed from it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = True
    """The reply ended with the end-of-turn token (not cut at ``max_tokens``)."""

    def completion(self) -> Completion:
        """The turn as a gated session's :class:`~harnesses.gate.Completion`, its token ids
        and logprobs in the metadata (:func:`~harnesses.trainer.build_sample` reads them)."""
        return Completion.model_validate(
            {
                "content": self.content if self.content or not self.tool_calls else None,
                "tool_calls": self.tool_calls,
                "finish_reason": "stop" if self.finished else "length",
                "usage": {
                    "prompt_tokens": len(self.prompt_ids),
                    "completion_tokens": len(self.completion_ids),
                },
                "metadata": {
                    "prompt_token_ids": self.prompt_ids,
                    "token_ids": self.completion_ids,
                    "logprobs": self.logprobs,
                },
            }
        )


class TokenChain:
    """The token ids of one conversation so far, extended turn by turn (see the module)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._messages: list[Message] = []
        self._tools: list[dict[str, Any]] | None = None
        self._ended = True

    def _render(self, messages: Sequence[Message], tools: Any, generation: bool) -> str:
        text = self._tokenizer.apply_chat_template(
            list(messages), tools=tools or None, add_generation_prompt=generation, tokenize=False
        )
        return str(text)

    def prompt_ids(
        self, messages: Sequence[Message], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The ids the next turn is sampled from.

        Raises:
            SampleError: ``messages`` does not continue the conversation this chain holds
                (the harness rewrote its history), or the template is not prefix-preserving.
        """
        messages = [dict(m) for m in messages]
        if not self._ids:
            ids = self._tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            self._messages, self._tools = messages, tools
            return list(ids)
        known = len(self._messages) + 1  # the conversation so far and the last reply
        if (
            len(messages) <= known
            or tools != self._tools
            or messages[: known - 1] != self._messages[: known - 1]
        ):
            raise SampleError(
                "the conversation does not extend the previous turn's "
                "(the harness rewrote its history): the token ids cannot chain"
            )
        # The prompt the previous reply was sampled from, as the template renders it now:
        # what follows it in the new rendering is that reply (the model's own ids stand for
        # it, however the template re-renders it), then the new messages.
        before = self._render(messages[: known - 1], tools, generation=True)
        after = self._render(messages, tools, generation=True)
        eos = self._tokenizer.eos_token or ""
        end = after.find(eos, len(before)) if eos else -1
        if not after.startswith(before) or end < 0:
            raise SampleError(
                "the chat template renders earlier messages differently once "
                "later ones follow (not prefix-preserving): ids cannot chain"
            )
        glue = ("" if self._ended else eos) + after[end + len(eos) :]
        self._messages = messages
        return self._ids + list(self._tokenizer.encode(glue, add_special_tokens=False))

    def extend(self, prompt_ids: list[int], turn: GeneratedTurn) -> None:
        """Record the sampled turn (after :meth:`prompt_ids` gave ``prompt_ids``)."""
        self._ids = prompt_ids + turn.completion_ids
        self._ended = turn.finished


class TransformersGenerator:
    """Samples turns from a ``transformers`` causal LM on this process (CPU or GPU).

    Use it as a gated session's ``generate`` (``run_rollouts(factory, tasks, generator)``):
    each rollout id gets its own :class:`TokenChain`. ``model`` may change between calls
    (pass a function returning the current model, e.g. ``lambda: trainer.model``).

    Args:
        model: the model, or a function returning it.
        tokenizer: its tokenizer, with a chat template that can render tools.
        max_tokens, temperature, top_p: defaults; a call's ``sampling`` overrides them.
        parse: ``text -> (content, tool_calls)`` (default: the Hermes / Qwen format).
    """

    def __init__(
        self,
        model: Any | Callable[[], Any],
        tokenizer: Any,
        *,
        max_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        parse: Callable[[str], ParsedReply] = parse_hermes_tool_calls,
    ):
        self._model = model
        self.tokenizer = tokenizer
        self.defaults = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        self.parse = parse
        self._chains: dict[str, TokenChain] = {}
        self._lock = threading.Lock()

    @property
    def model(self) -> Any:
        import torch.nn

        return self._model if isinstance(self._model, torch.nn.Module) else self._model()

    def chain(self) -> TokenChain:
        return TokenChain(self.tokenizer)

    def forget(self, rollout_id: str) -> None:
        """Drop a finished rollout's chain."""
        self._chains.pop(rollout_id, None)

    def sample(
        self,
        chain: TokenChain,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None,
        sampling: Mapping[str, Any] | None = None,
    ) -> GeneratedTurn:
        """Sample the next turn of ``chain``'s conversation (blocking).

        Raises:
            SampleError: as :meth:`TokenChain.prompt_ids`.
        """
        import torch

        options = {
            **self.defaults,
            **{k: v for k, v in (sampling or {}).items() if k in self.defaults and v is not None},
        }
        prompt = chain.prompt_ids(messages, tools)
        tokenizer = self.tokenizer
        with self._lock, torch.no_grad():
            model = self.model
            was_training = model.training
            model.eval()
            try:
                device = next(model.parameters()).device
                inputs = torch.tensor([prompt], device=device)
                temperature = float(options["temperature"])
                output = model.generate(
                    inputs,
                    attention_mask=torch.ones_like(inputs),
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_p=float(options["top_p"]),
                    top_k=0,
                    max_new_tokens=int(options["max_tokens"]),
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
                completion = output[0, len(prompt) :].tolist()
                if (
                    tokenizer.pad_token_id is not None
                    and tokenizer.pad_token_id != tokenizer.eos_token_id
                ):
                    while completion and completion[-1] == tokenizer.pad_token_id:
                        completion.pop()
                logits = model(output[:, : len(prompt) + len(completion)]).logits[0]
                scaled = logits[len(prompt) - 1 : -1].float() / (
                    temperature if temperature > 0 else 1.0
                )
                chosen = torch.tensor(completion, device=device).unsqueeze(1)
                logprobs = torch.log_softmax(scaled, dim=-1).gather(1, chosen).squeeze(1).tolist()
            finally:
                model.train(was_training)
        finished = bool(completion) and completion[-1] == tokenizer.eos_token_id
        text = tokenizer.decode(completion, skip_special_tokens=False)
        visible = text.replace(tokenizer.eos_token or "\0", "")
        content, calls = self.parse(visible)
        turn = GeneratedTurn(
            prompt, completion, [float(x) for x in logprobs], text, content, calls, finished
        )
        chain.extend(prompt, turn)
        return turn

    async def __call__(
        self,
        rollout_id: str,
        turn: int,
        messages: list[Message],
        tools: list[dict[str, Any]] | None,
        sampling: dict[str, Any],
    ) -> Completion:
        """A gated session's ``generate``: the next turn of rollout ``rollout_id``, sampled in
        a worker thread. Raises: SampleError (the conversation cannot chain)."""
        chain = self._chains.get(rollout_id)
        if chain is None or turn == 0:
            chain = self._chains[rollout_id] = self.chain()
        generated = await anyio.to_thread.run_sync(self.sample, chain, messages, tools, sampling)
        return generated.completion()
