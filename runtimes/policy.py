"""The policy's own user: privilege separation inside a sandbox.

A rollout's policy is the adversary of everything that runs after it (``docs/security.md``).
Where a backend can switch users, the policy's commands run as an unprivileged account of
their own (:attr:`~runtimes.base.Runtime.policy_user`, ``vf-policy`` by default on Docker and
Modal), while the sandbox's default user — root there — keeps the host's machinery: the
channel agent, harness installs, judge inputs and judges. The policy then cannot write to,
signal or ptrace any of it.

The account is made on first use, by :class:`PolicyAccount`, right before the first command
that asks for it: one root command adds it to ``/etc/passwd`` when the image lacks it, gives it
a home, and hands it the workdir (the world it works on). Sandboxes that never run a policy
pay nothing.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

import anyio

from .errors import ProvisioningError

DEFAULT_POLICY_USER = "vf-policy"
POLICY_UID = 10001
"""uid and gid of an account this module creates (images rarely use uids over 10000)."""

DEFAULT_JUDGE_USER = "vf-judge"
JUDGE_UID = 10002
"""uid and gid of the judges' account, where this module creates it: distinct from the
policy's, so what a judge runs (the policy's programs included) acts with neither root's nor
the policy's rights (``docs/security.md``, "Judges' own account")."""

_NAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")

_ENSURE = r"""
u=$1 uid=$2 wd=$3 create=$4
if ! id -u -- "$u" >/dev/null 2>&1; then
  [ "$create" = 1 ] || { echo "no such user: $u" >&2; exit 5; }
  if ! grep -q "^$u:" /etc/group 2>/dev/null; then
    printf '%s:x:%s:\n' "$u" "$uid" >> /etc/group || exit 3
  fi
  printf '%s:x:%s:%s:vf-sandbox policy:/home/%s:/bin/sh\n' "$u" "$uid" "$uid" "$u" \
    >> /etc/passwd || exit 3
fi
home=""
while IFS=: read -r n _ _ _ _ h _; do [ "$n" = "$u" ] && home=$h; done < /etc/passwd
if [ -n "$home" ] && [ "$home" != / ]; then mkdir -p -- "$home" && chown -- "$u:" "$home"; fi
if [ "$wd" != / ]; then chown -R -P -h -- "$u:" "$wd" || exit 4; fi
if [ -n "$5" ]; then chmod o+x -- "$5" || exit 4; fi
"""
"""Run as root: make the account if missing (when allowed), give it a home and the workdir
(never ``/``), and let it through the directory ``$5`` above the workdir (when given).
``-P -h``: links are changed themselves, never followed."""


def validate_policy_user(value: str | None) -> str | None:
    """Field validator: a plain account name (no uid:gid, no root).

    Raises:
        ValueError: not a portable user name, or root.
    """
    if value is None:
        return None
    if not _NAME.fullmatch(value):
        raise ValueError(f"policy_user must be a plain user name, got {value!r}")
    if value == "root":
        raise ValueError("policy_user cannot be root: leave it unset to run the policy as root")
    return value


RunAsMachinery = Callable[[list[str]], Awaitable[tuple[int, bytes]]]
"""Runs argv as the sandbox's default user (root where there is a policy account);
returns the exit code and stderr."""


class PolicyAccount:
    """Makes the policy's account once per sandbox, before the first command that uses it."""

    def __init__(self) -> None:
        self.ready = False
        """Whether the account is made and handed its directory (a fork whose snapshot holds
        it already sets this)."""
        self._lock = anyio.Lock()

    async def ensure(
        self,
        name: str,
        run: RunAsMachinery,
        workdir: str,
        *,
        create: bool,
        through: str = "",
        uid: int = POLICY_UID,
    ) -> None:
        """Create the account ``name`` and hand it the workdir, unless done already.

        ``create``: add the account to ``/etc/passwd`` when missing (a sandbox of ours), or
        refuse (a host we only borrow a directory of). ``through``: a directory above the
        workdir the account must be able to pass (made ``o+x``). ``workdir`` ``"/"``: hand
        the account no directory (the judges' account). ``uid``: of a created account.

        Raises:
            ProvisioningError: the account is missing and may not be made, or could not be
                made (no writable ``/etc/passwd``, no ``chown``).
        """
        if self.ready:
            return
        async with self._lock:
            if not self.ready:  # else a concurrent first use made it meanwhile
                await _make(name, run, workdir, create=create, through=through, uid=uid)
                self.ready = True


async def _make(
    name: str, run: RunAsMachinery, workdir: str, *, create: bool, through: str, uid: int
) -> None:
    argv = [name, str(uid), workdir, str(int(create)), through]
    code, err = await run(["sh", "-c", _ENSURE, "sh", *argv])
    if code != 0:
        detail = err.decode("utf-8", "replace").strip() or f"exit status {code}"
        raise ProvisioningError(f"cannot prepare the account {name!r} in the sandbox: {detail}")
