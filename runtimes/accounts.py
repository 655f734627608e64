"""The accounts a sandbox's commands run as: the policy's and the judges', apart from the
machinery's default user (``docs/security.md``). Made on first use
(:meth:`Accounts._ensure_account`) or ahead of it (``prepare_*_user``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from .guards import Guarded
from .machinery import run_machinery
from .models import ExecRequest
from .policy import DEFAULT_JUDGE_USER, JUDGE_UID, PolicyAccount

if TYPE_CHECKING:
    from .base import Runtime


class Accounts(Guarded):
    """The policy's and the judges' accounts (see the module)."""

    _policy_account: PolicyAccount
    _judge_account: PolicyAccount

    @property
    def policy_user(self) -> str | None:
        """The unprivileged user a rollout's policy runs its commands as (``exec(user=)``),
        apart from the sandbox's default user, which the host's own machinery uses (judge
        inputs, judges, harness installs, the channel agent). The policy cannot write to,
        signal or ptrace what runs as the default user.

        ``None`` when the backend keeps no separate policy identity: the policy then runs
        as the default user (``docs/security.md`` says what still holds).
        """
        return None

    @property
    def judge_user(self) -> str | None:
        """The account judges run their commands as (``vf-judge``), apart from both the
        policy's account and the machinery's default user: what a judge runs — the
        policy's programs included — can neither replace the sandbox's system files (as
        root could) nor act as the policy. It exists where the policy has an account of its
        own in a sandbox whose accounts are the runtime's to make (Docker and Modal unless
        the root filesystem is read-only); ``None`` elsewhere (judges then run as the
        default user, as before). Made on first use, handed no directory.
        """
        if self.policy_user is None or not self._makes_accounts():
            return None
        return DEFAULT_JUDGE_USER

    def _makes_accounts(self) -> bool:
        """Whether accounts (the judges') may be added to this sandbox's ``/etc/passwd``."""
        return self._creates_policy_user

    async def system_tampered(self) -> str | None:
        """Why this sandbox's system can no longer be trusted to run a judge's commands —
        code every program would load (``/etc/ld.so.preload``) or a shell the commands run
        through, changed since the sandbox started from its image — or ``None``: nothing
        seen, or a backend that cannot tell without running the sandbox's own programs
        (only Docker reads the engine's diff). Judges placed in a rollout's sandbox (or a
        fork of it) are refused when it says why.

        Raises:
            SandboxError: the sandbox failed.
        """
        return None

    async def prepare_judge_user(self) -> str | None:
        """Make the judges' account now (it is made on first use otherwise); return
        :attr:`judge_user`.

        Raises:
            ProvisioningError: the account could not be made.
        """
        if self.judge_user is not None:
            await run_machinery(cast("Runtime", self), ["true"], user=self.judge_user, timeout=60)
        return self.judge_user

    async def prepare_policy_user(self) -> str | None:
        """Make the policy's account now (where it is made on first use) and hand it the
        workdir, as its first command would; return :attr:`policy_user`. Lets the host
        give the account something by name (``chown``) before the policy runs.

        Raises:
            ProvisioningError: the account could not be made.
        """
        if self.policy_user is not None:
            await run_machinery(cast("Runtime", self), ["true"], user=self.policy_user, timeout=60)
        return self.policy_user

    async def _ensure_account(self, request: ExecRequest) -> None:
        """Make or find the policy's or the judge's account at its first use."""
        if request.user is not None and request.user == self.policy_user:
            await self._policy_account.ensure(
                request.user,
                self._run_as_machinery,
                self.workdir,
                create=self._creates_policy_user,
                through=self._policy_passage(),
            )
        elif request.user is not None and request.user == self.judge_user:
            await self._judge_account.ensure(
                request.user,
                self._run_as_machinery,
                "/",
                create=self._creates_policy_user,
                through=self._policy_passage(),
                uid=JUDGE_UID,
            )

    def _prepared_policy_user(self) -> str | None:
        """The policy's account, if it was made and handed the workdir already."""
        ready = self._policy_account.ready
        return self.policy_user if ready else None

    _creates_policy_user: ClassVar[bool] = True
    """Whether a missing policy account is added to the sandbox (ours) or refused (a host
    whose accounts are not ours to make)."""

    def _policy_passage(self) -> str:
        """A directory above the workdir the policy account must be able to pass, or ""."""
        return ""

    async def _run_as_machinery(self, argv: list[str]) -> tuple[int, bytes]:
        request, sink = self._internal(argv)
        with self._guard("preparing the policy's account"):
            code = await self._routed_exec(request, sink)
        return code, bytes(sink.stderr)
