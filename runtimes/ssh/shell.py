"""``vf-sandbox shell`` for SSH: the OpenSSH ``ssh`` command line that opens the login shell
in a sandbox's workdir, with the config's host, port, user, key and host-key checking."""

from __future__ import annotations

import os
import shlex
import shutil
import tempfile
from pathlib import Path

from ..errors import SandboxFileNotFoundError, SandboxInvalidArgumentError
from ..models import SandboxInfo
from .config import SSHConfig
from .control import valid_sandbox_dir

_PINNED_ALIAS = "vf-sandbox-pinned-host"


def _ssh_cli() -> str:
    found = shutil.which("ssh")
    if found is None:
        raise SandboxFileNotFoundError(
            "ssh", "the OpenSSH client is not installed (Debian: apt-get install openssh-client)"
        )
    return found


def _host_key_options(cfg: SSHConfig) -> list[str]:
    """Strict checking against what the runtime itself checks against."""
    if cfg.host_key is not None:
        # A pinned key: a known_hosts file of that one line, under an alias of its own.
        folder = Path(tempfile.mkdtemp(prefix="vf-sandbox-shell-"))
        known = folder / "known_hosts"
        known.write_text(f"{_PINNED_ALIAS} {cfg.host_key}\n")
        return ["-o", f"UserKnownHostsFile={known}", "-o", f"HostKeyAlias={_PINNED_ALIAS}"]
    checking = "no" if cfg.accept_unknown_host_key else "yes"
    known_hosts = os.path.expanduser(cfg.known_hosts)
    return ["-o", f"StrictHostKeyChecking={checking}", "-o", f"UserKnownHostsFile={known_hosts}"]


def _auth_options(cfg: SSHConfig) -> list[str]:
    if cfg.key_file:
        only = [] if cfg.use_agent else ["-o", "IdentitiesOnly=yes"]
        return ["-i", os.path.expanduser(cfg.key_file), *only]
    if cfg.key_env and not cfg.use_agent and cfg.password is None:
        raise SandboxInvalidArgumentError(
            "key_env: the ssh CLI cannot take a key from an environment variable; "
            "give key_file (or use_agent) for `vf-sandbox shell`"
        )
    return []  # the agent, or ssh asks for the password


def ssh_shell_argv(info: SandboxInfo, cfg: SSHConfig, *, tty: bool) -> list[str]:
    """``ssh -t|-T ... user@host 'cd WORKDIR && exec $SHELL'``: the workdir is the config's
    ``workdir`` when it names one, else the sandbox directory's ``work``.

    Raises:
        SandboxFileNotFoundError: the ssh CLI is not installed.
        SandboxInvalidArgumentError: ``info`` is not an ssh sandbox directory, or the config
            authenticates only with ``key_env``.
    """
    if not valid_sandbox_dir(info.id):
        raise SandboxInvalidArgumentError(f"not an ssh sandbox directory: {info.id!r}")
    workdir = cfg.workdir or f"{info.id}/work"
    remote = f'cd -- {shlex.quote(workdir)} || exit 1; exec "${{SHELL:-/bin/sh}}"'
    cli, auth = _ssh_cli(), _auth_options(cfg)
    return [
        cli,
        "-t" if tty else "-T",
        "-p",
        str(cfg.port),
        *_host_key_options(cfg),
        *auth,
        "-l",
        cfg.username,
        "--",
        cfg.host,
        remote,
    ]
