"""What a failed conformance check tells the plugin author: what was expected and what the
backend gave, not a bare ``ExecResult`` repr."""

from __future__ import annotations

from typing import Any, cast

import pytest

from runtimes import ExecResult, Runtime
from runtimes.testing.exec_checks import check_user


class _IgnoresUser:
    """A backend that runs as root and ignores ``user=``: the bug ``check_user`` catches."""

    async def exec(self, argv: list[str], *, user: str | None = None, **_: Any) -> ExecResult:
        out = b"0\n" if argv == ["id", "-u"] else b"root\n"
        return ExecResult(exit_code=0, stdout_bytes=out, stderr_bytes=b"")


@pytest.mark.anyio
async def test_check_user_says_what_it_expected_and_what_it_got() -> None:
    with pytest.raises(AssertionError) as info:
        await check_user(cast(Runtime, _IgnoresUser()))
    message = str(info.value)
    assert "expected 'nobody'" in message and "got 'root'" in message, message
    assert "ExecResult(" not in message, message
