"""A tiny causal LM and tokenizer built here, from configs (no hub, no download).

The tokenizer is a byte-level BPE trained on a few sentences, with the special tokens and
the chat template of the Qwen3 family (TRL ships that template and knows how to parse its
tool calls). The model is a Llama with hidden size 32 and 2 layers. A random model never
emits a tool call, so :func:`prime` teaches it, with a few supervised steps, to answer a
prompt with one of a handful of ``bash`` tool calls; sampling then gives tool calls that
differ between completions (and so do the rewards the sandbox computes from them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl.chat_template_utils import qwen3_chat_template

SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<tools>",
    "</tools>",
]

ANSWERS = ["1", "2", "3", "4"]
"""The tool calls :func:`prime` teaches: ``echo N > answer.txt`` for each N."""

TASK = "Write the number four into answer.txt."


def command(answer: str) -> str:
    return f"echo {answer} > answer.txt"


def tool_call_text(answer: str) -> str:
    call = {"name": "bash", "arguments": {"command": command(answer)}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


_CORPUS = [
    "You may call one or more functions to assist with the user query.",
    "You are provided with function signatures within XML tags",
    "For each function call, return a json object with function name and arguments",
    '{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",'
    ' "parameters": {"type": "object", "properties": {"command": {"type": "string"}},'
    ' "required": ["command"]}}}',
    "system user assistant tool Tools function-name args-json-object",
    TASK,
    "read_file write_file path content exit code stdout stderr the command failed",
] + [tool_call_text(a) for a in ANSWERS]


def build_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """Train the BPE on the corpus, save it under ``directory`` and load it back."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL[1:],
    )
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(directory)
    return PreTrainedTokenizerFast.from_pretrained(directory)


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def prompt_ids(
    tokenizer: PreTrainedTokenizerFast,
    tools: Sequence[Any] | None,
    messages: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """The ids of the first generation prompt: ``messages`` (default: the task as the user's
    message) with ``tools`` (OpenAI tool dicts or Python callables)."""
    messages = list(messages) if messages else [{"role": "user", "content": TASK}]
    ids = tokenizer.apply_chat_template(
        messages,
        tools=list(tools) if tools else None,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def prime(
    model: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    prompts: Sequence[Sequence[int]],
    steps: int = 150,
) -> None:
    """Supervised steps on ``prompt -> tool call`` pairs (the loss on the reply only) for
    each of ``prompts`` (ids from :func:`prompt_ids`), so that sampling at temperature 1
    from any of them mostly gives one of the :data:`ANSWERS`' ``bash`` tool calls."""
    rows = []
    for prefix in prompts:
        for answer in ANSWERS:
            reply = tokenizer.encode(tool_call_text(answer), add_special_tokens=False)
            rows.append((list(prefix), [*reply, tokenizer.eos_token_id]))
    # One right-padded batch of every (prompt, reply) pair: one forward and backward per step.
    width = max(len(c) + len(r) for c, r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([c + r + [pad] * (width - len(c) - len(r)) for c, r in rows])
    mask = torch.tensor(
        [[1] * (len(c) + len(r)) + [0] * (width - len(c) - len(r)) for c, r in rows]
    )
    labels = torch.tensor(
        [[-100] * len(c) + r + [-100] * (width - len(c) - len(r)) for c, r in rows]
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
    model.eval()
