"""Conformance classes that repeat a backend as another user (``user_variant = True``: Docker as
``nobody``, SSH with a password account) exist for what depends on the user: permissions,
``user=``, the agent's and the shell's privileges. The streaming checks (``stream_*`` and the
``on_output`` callback's ``on_output_*``) and the incremental-stdin checks run the same code
whoever the user is, on every backend's main classes (with and without the channel); they are
deselected on these variants to keep the suite's time. (Killing a command's tree as the
sandbox's user, which ``on_output_error_kills_tree`` ends with, stays covered there by
``timeout_kills_tree`` and ``cancellation_kills_tree``.)"""

from __future__ import annotations

import pytest

USER_INDEPENDENT_PREFIXES = ("stream_", "on_output_", "stdin_iterable_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, dropped = [], []
    for item in items:
        cls = getattr(item, "cls", None)
        check = getattr(item, "callspec", None)
        name = check.id if check is not None else ""
        variant = cls is not None and getattr(cls, "user_variant", False)
        (dropped if variant and name.startswith(USER_INDEPENDENT_PREFIXES) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
