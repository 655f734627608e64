"""docs/inspect.md's offline ``mockllm`` example, run as it stands: its model answers with
the usage it was given and never downloads a tokenizer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "inspect.md"


def _mockllm_example() -> str:
    text = DOC.read_text()
    section = text.split("**Offline evals with `mockllm`", 1)[1]
    match = re.search(r"^```python\n(.*?)^```$", section, re.S | re.M)
    assert match, "docs/inspect.md lost its mockllm example"
    return match.group(1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_mockllm_example_generates_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken.load

    def refuse(blobpath: str) -> bytes:
        raise AssertionError(f"the example tried to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)
    namespace: dict[str, Any] = {}
    exec(compile(_mockllm_example(), str(DOC), "exec"), namespace)
    output = await namespace["model"].generate("What is 6 * 7?")
    assert output.completion == "The answer is 42."
    assert output.usage is not None and output.usage.total_tokens == 20
