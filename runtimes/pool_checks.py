"""What :class:`~runtimes.pool.RuntimePool`'s constructor checks before it makes anything:
its numbers, that the config's sandboxes can be handed to one acquirer each, and (with
``recycle=True``) that they can be proven clean after use."""

from __future__ import annotations

from .config import RuntimeConfig, RuntimeConfigError
from .errors import ProvisioningError, SandboxInvalidArgumentError
from .recycle import Recycler, recycle_refusal
from .registry import open_runtime

__all__ = ["check_numbers", "check_poolable", "recycler_for"]


def check_numbers(
    size: int,
    max_create_concurrency: int,
    idle_timeout: float | None,
    create_attempts: int,
    retry_backoff: tuple[float, float],
) -> None:
    """Raises:
    SandboxInvalidArgumentError: a size, limit, timeout or backoff out of range.
    """
    problems = []
    if size < 0:
        problems.append(f"size must be >= 0, got {size}")
    if max_create_concurrency < 1:
        problems.append(f"max_create_concurrency must be >= 1, got {max_create_concurrency}")
    if idle_timeout is not None and not idle_timeout > 0:
        problems.append(f"idle_timeout must be > 0 or None, got {idle_timeout}")
    if create_attempts < 1:
        problems.append(f"create_attempts must be >= 1, got {create_attempts}")
    first, longest = retry_backoff
    if not 0 <= first <= longest:
        problems.append(
            f"retry_backoff must be (first, longest), 0 <= first <= longest, got {retry_backoff}"
        )
    if problems:
        raise SandboxInvalidArgumentError("; ".join(problems))


def recycler_for(config: RuntimeConfig, audit_every: int) -> Recycler:
    """The pool's :class:`~runtimes.recycle.Recycler` for ``config``.

    Raises:
        RuntimeConfigError: its sandboxes cannot be proven clean after use (why, in words).
        SandboxInvalidArgumentError: ``audit_every`` below 1.
    """
    if audit_every < 1:
        raise SandboxInvalidArgumentError(f"audit_every must be >= 1, got {audit_every}")
    refusal = recycle_refusal(open_runtime(config))  # unstarted: nothing is made
    if refusal is not None:
        raise RuntimeConfigError(f"recycle=True: {refusal}")
    return Recycler(audit_every)


def check_poolable(config: RuntimeConfig) -> None:
    """Raises:
    RuntimeConfigError: ``keep=True``, or a config that borrows one existing sandbox.
    """
    if config.keep:
        raise RuntimeConfigError(
            "a pool closes the sandboxes it does not hand out: keep=True cannot be pooled"
        )
    if open_runtime(config).keeps_sandbox():  # an unstarted runtime: nothing is made
        raise RuntimeConfigError(
            f"this {config.type} config borrows one existing sandbox (attach mode): "
            "every acquirer of a pool would share it"
        )


def provisioning_error(
    pool: str, attempts: int, failure: BaseException | None
) -> ProvisioningError:
    """What a pool's acquirers get once a creation failed ``attempts`` times (``failure``,
    the last attempt's error, chained)."""
    error = ProvisioningError(
        f"{pool}: could not create a sandbox in {attempts} attempts: {failure}"
    )
    error.__cause__ = failure
    return error
