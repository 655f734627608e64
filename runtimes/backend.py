"""The :class:`Backend` seam: how to reach one kind of sandbox, and nothing else.

A backend says how to create, destroy and probe its sandbox and how to run one process in it
with pipes (:meth:`Backend.spawn`). Everything else lives once, above it, in the
:class:`~runtimes.base.Runtime` that :func:`runtime_class` composes around it: argument
checks, paths, timeouts, output caps, the lifecycle, the channel routing, the sweep of the
processes a sandbox's commands left behind, the kills still owed, and a generic plain path
over ``spawn`` for every file operation (``head``, ``cat``, ``test``, ``rm``, ``tar`` in the
sandbox).

What a backend does better than that generic path it declares as a *capability*, by also
subclassing the capability's class (:mod:`runtimes.capabilities`); the runtime uses it where
it is declared.

A runtime plugin is a :class:`Backend` subclass named by an entry point in
``vf_sandbox.runtimes`` (docs/plugins.md builds one); the registry composes its runtime
(:func:`runtimes.composed.runtime_class`).
"""

from __future__ import annotations

import abc
from collections.abc import Collection
from dataclasses import dataclass
from typing import ClassVar, Literal

from .config import RuntimeConfig
from .models import ExecRequest, OutputSink
from .policy import DEFAULT_JUDGE_USER
from .snapshot import SandboxSnapshot
from .sweep import kill_argv

__all__ = [
    "Backend",
    "CreateRequest",
    "SweepScope",
    "bookkeeping_request",
]


class Backend(abc.ABC):
    """How to reach one kind of sandbox: four methods, an id and two class attributes.

    One instance serves one sandbox, from :meth:`create` to :meth:`destroy`. Every method
    may raise :class:`~runtimes.errors.SandboxUnavailableError` for a sandbox that is gone
    and :class:`~runtimes.errors.SandboxTransportError` for a connection to it that failed;
    anything that is not a :class:`~runtimes.errors.SandboxError` reaches the caller
    wrapped in one ("failed unexpectedly"), so raise typed errors.
    """

    name: ClassVar[str]
    """The type name (``{"type": name}`` in a config): in messages, labels and ``ls``."""
    config_model: ClassVar[type[RuntimeConfig]]
    """The config: a :class:`~runtimes.config.RuntimeConfig` subclass whose ``type`` is
    ``Literal[name]`` defaulting to ``name``."""
    keep_supported: ClassVar[bool] = False
    """Whether :meth:`destroy` honours ``keep=True`` (without it the config is refused)."""
    destroy_ends_processes: ClassVar[bool] = False
    """Whether :meth:`destroy` ends every process in the sandbox by itself (a container,
    a VM). When it does not, the runtime sweeps what its commands left before it."""
    pid_namespace: ClassVar[bool] = False
    """Whether the sandbox has a pid namespace of its own, so that every process started
    after :meth:`create` is one of its commands' however it detached itself (``setsid``,
    ``env -i``): the runtime's sweep then takes them all, not only those that carry the
    mark (the channel's agent spared)."""
    creates_policy_user: ClassVar[bool] = True
    """Whether a missing :attr:`policy_user` account is added to the sandbox (its accounts
    are ours) or refused (a host whose accounts are not ours to make)."""

    def __init__(self, config: RuntimeConfig):
        self.config = config
        self.owed_kills: set[int] = set()
        """Process groups whose kill could not be delivered (:meth:`owe_kill`): the runtime
        kills them (:meth:`kill_groups`, guarded by the mark) before the next command and
        before a sandbox it attached to is let go."""

    def owe_kill(self, pgid: int) -> None:
        """Record a process group this backend could not kill (a kill not delivered, a
        command it lost track of that may still run): the runtime pays the kill later."""
        self.owed_kills.add(pgid)

    async def kill_groups(self, pgids: Collection[int], *, mark: str | None) -> None:
        """SIGKILL these process groups (each leader first); with ``mark`` (``NAME=value``)
        only those whose leader still carries it, so a kill paid late cannot hit a process
        that reused the id. The default runs :func:`runtimes.sweep.kill_argv` through
        :meth:`spawn`; a backend with a way of its own (a control connection, a privileged
        exec) overrides it.

        Raises:
            SandboxError: the kill could not be delivered.
        """
        request, sink = bookkeeping_request(kill_argv(pgids, mark=mark), cwd="/")
        await self.spawn(request, sink)

    def route_hint(self) -> str:
        """What to tell a caller who asked for a route to the host this sandbox cannot
        offer (what to configure)."""
        return ""

    def check_request(self, request: ExecRequest) -> None:
        """Refuse, before the channel or :meth:`spawn` sees it, what :meth:`spawn` would
        refuse in its own words, so both paths give the same error (a user the sandbox
        cannot switch to, an argv over the transport's limits).

        Raises:
            SandboxError: the request cannot run here.
        """
        return None

    def sweep_scope(self) -> SweepScope:
        """Which processes :meth:`runtimes.Runtime.stop_processes` and the sweep before
        :meth:`destroy` kill (unless the backend is a :class:`ProcessSweeper`): by default
        those that carry the mark, or, with :attr:`pid_namespace`, every process started
        after :meth:`create`."""
        return SweepScope()

    def makes_accounts(self) -> bool:
        """Whether accounts (the judges') may be added to the sandbox's ``/etc/passwd``."""
        return self.creates_policy_user

    @property
    def judge_user(self) -> str | None:
        """The judges' account (:attr:`runtimes.Runtime.judge_user`): ``vf-judge`` where the
        policy has an account of its own in a sandbox whose accounts are ours to make."""
        if self.policy_user is None or not self.makes_accounts():
            return None
        return DEFAULT_JUDGE_USER

    def policy_passage(self) -> str:
        """A directory above the workdir the policy's account must be able to pass (made
        searchable for it), or ``""``."""
        return ""

    async def system_tampered(self) -> str | None:
        """:meth:`runtimes.Runtime.system_tampered`: why the sandbox's system files can no
        longer be trusted to run a judge's commands, as seen without running its code (a
        backend that cannot tell: ``None``)."""
        return None

    @property
    def sandbox_id(self) -> str | None:
        """The backend's own id for the sandbox (``None`` before :meth:`create`): the id
        :meth:`SandboxLister.list_sandboxes` reports, so a user who reads it in an error
        finds the same row in ``vf-sandbox ls``."""
        return None

    @abc.abstractmethod
    async def create(self, request: CreateRequest) -> str:
        """Create the sandbox (or attach to the one the config names) and return its
        absolute, writable workdir.

        Runs shielded from cancellation. Keep a handle on what was created before any
        further await: if ``create`` raises, :meth:`destroy` runs to remove what was made.
        Store ``request.labels`` with what you create, where a later process can read them
        and the sandbox's code cannot rewrite them (container labels, cloud tags, a file
        beside the sandbox): :meth:`SandboxLister.list_sandboxes` reports them.

        Raises:
            ProvisioningError: the sandbox could not be created.
        """

    @abc.abstractmethod
    async def destroy(self, *, keep: bool) -> None:
        """Destroy the sandbox, or release one the config only attached to. Runs once,
        after :meth:`create` began, and must cope with a half-finished ``create``.

        ``keep`` (only if :attr:`keep_supported`): release what the host holds and leave
        the sandbox, processes and all, for debugging.

        Raises:
            SandboxTransportError: the backend could not confirm the sandbox is gone.
        """

    @abc.abstractmethod
    async def alive(self) -> bool:
        """Whether the sandbox answers: ``False`` for a dead one, never an error for it.

        Raises:
            SandboxTransportError: the backend cannot tell.
        """

    @abc.abstractmethod
    async def spawn(self, request: ExecRequest, sink: OutputSink) -> int:
        """Run one process in the sandbox with pipes; return its exit code (``128 + N``
        after signal N).

        Feed ``request.stdin`` (:func:`runtimes.stdin_feed.feed_stdin`), stream its output
        into ``sink`` as it comes (stop reading when ``sink.feed`` returns ``False``), call
        ``sink.exited(code)`` the moment the process exits and set ``sink.pid`` once known.
        When cancelled (a timeout, the output cap, the caller), kill its whole process
        group, shielded, then let the cancellation propagate.

        Raises:
            SandboxFileNotFoundError: the program or ``cwd`` is missing.
            SandboxPermissionError: the program cannot be run; ``user`` cannot be switched
                to (:func:`~runtimes.errors.cannot_run_as`).
            SandboxNotADirectoryError: ``cwd`` is not a directory.
            SandboxInvalidArgumentError: argv over the kernel's limit; an unknown ``user``
                (:func:`~runtimes.errors.no_such_user`).
        """

    @property
    def policy_user(self) -> str | None:
        """The unprivileged account a rollout's policy runs its commands as
        (:attr:`runtimes.Runtime.policy_user`; made on first use), or ``None``: the policy
        runs as the default user."""
        return None

    def live_cap(self) -> int | None:
        """How many sandboxes of this backend may be alive at once in this process (a
        config field such as ``max_live``); :meth:`runtimes.Runtime.start` waits for a
        slot. ``None``: no cap."""
        return None

    async def prepare(self, request: CreateRequest) -> None:
        """Cancellable work before the shielded :meth:`create`, with the live slot held:
        pacing against an API's rate limit, or a creation the backend can cancel itself
        (keep the handle at once, so that :meth:`destroy` removes it if the start goes no
        further)."""
        return None

    @property
    def attached(self) -> bool:
        """Whether :meth:`create` attached to a sandbox that existed before (code of others
        may have run in it) rather than making a fresh one. The runtime then kills what its
        commands left before letting it go, and never starts the channel's agent in it
        (the agent's interpreter would be found on that sandbox's ``PATH``)."""
        return False

    def describe(self) -> str:
        """A short human name for messages: the type name and the sandbox id."""
        return f"{self.name} sandbox {self.sandbox_id or '(not started)'}"


@dataclass(frozen=True)
class CreateRequest:
    """What the runtime asks of :meth:`Backend.create`, besides the config."""

    labels: dict[str, str]
    """The sandbox's labels (:func:`runtimes.ownership.ownership_labels`: its creator, the
    creation time, whether it is kept, the config's ``labels``)."""
    mark: str
    """The value of ``VF_SANDBOX_RUNTIME`` that every command of this sandbox carries
    (:data:`runtimes.sweep.MARK_VAR`): what sweeps find its processes by."""
    snapshot: SandboxSnapshot | None = None
    """The snapshot the sandbox's files start as (only for a :class:`Snapshotter`)."""
    policy_account_made: bool = False
    """Whether that snapshot holds the policy's account already made and handed the
    workdir (a fork leaves it as it is)."""


@dataclass(frozen=True)
class SweepScope:
    """Which processes a sweep kills (:meth:`Backend.sweep_scope`; the arguments of
    ``scripts/sweep.sh``): the channel's agent is always spared."""

    mode: Literal["mark", "all"] = "mark"
    """``mark``: those that carry the sandbox's mark (or work under ``home``, or run as one
    of ``users``; with :attr:`Backend.pid_namespace`, every process started after
    :meth:`Backend.create`); ``all``: every process outside PID 1's session (a sandbox of
    our own where every command is a session of its own, such as a container)."""
    users: tuple[str, ...] = ()
    """Accounts whose every process is the sandbox's (the policy's, the judges')."""
    home: str | None = None
    """A directory of the sandbox's own: a process working under it is the sandbox's."""
    as_root: bool = False
    """Run the sweep as ``uid 0`` (and by the channel's agent where it runs as root: it
    forks nothing, so it works at the sandbox's process limit)."""


def bookkeeping_request(
    argv: list[str], *, cwd: str, stdin: bytes | None = None, limit: int = 1 << 20
) -> tuple[ExecRequest, OutputSink]:
    """A request (and its sink) for the machinery's own commands in the sandbox: no caller
    environment, the default user, no timeout, output capped at ``limit``."""
    request = ExecRequest(
        argv=tuple(argv),
        cwd=cwd,
        env={},
        stdin=stdin,
        user=None,
        timeout=None,
        output_limit=limit,
    )
    return request, OutputSink(limit)
