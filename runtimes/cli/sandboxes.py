"""``vf-sandbox ls`` and ``vf-sandbox cleanup``: the labelled sandboxes (and their
snapshots) of every backend, listed or swept."""

from __future__ import annotations

import argparse
from typing import Any

import anyio

from runtimes import RuntimeConfig, SandboxError, SandboxInfo, available_runtimes, ownership
from runtimes.cleanup import (
    NOT_LISTABLE,
    SweepResult,
    cleanup_sandboxes,
    list_target,
    snapshot_info,
)

from .commands import CommandFactory
from .exec import run_interruptible
from .output import print_json, print_table, say, shorten
from .targets import runtime_targets


def cmd_cleanup(args: argparse.Namespace) -> int:
    results = anyio.run(
        run_interruptible,
        lambda: cleanup_sandboxes(
            runtime_targets(args.runtime),
            all_sessions=args.all,
            older_than=args.older_than,
            dry_run=args.dry_run,
            kept=args.kept,
        ),
    )
    counts = {
        action: sum(r.action == action for r in results)
        for action in ("removed", "would remove", "failed", "kept")
    }
    if args.json:
        rows = {
            kind: [
                {"backend": r.info.backend, "id": r.info.id, "action": r.action, "reason": r.reason}
                for r in results
                if r.kind == kind
            ]
            for kind in ("sandbox", "snapshot")
        }
        summary = {key.replace(" ", "_"): n for key, n in counts.items()}
        document = {"dry_run": args.dry_run, "results": rows["sandbox"], "summary": summary}
        print_json("cleanup", {**document, "snapshots": rows["snapshot"]})
    else:
        print_table(
            ["backend", "sandbox", "action", "reason"],
            [
                (r.info.backend, _shown_id(r), r.action, shorten(r.reason, args.verbose))
                for r in results
            ],
        )
        print("\n" + ", ".join(f"{n} {action}" for action, n in counts.items()))
    return 1 if counts["failed"] else 0


def _shown_id(result: SweepResult) -> str:
    return f"snapshot {result.info.id}" if result.kind == "snapshot" else result.info.id


def _listed(info: SandboxInfo) -> dict[str, Any]:
    session = {True: "dead", False: "alive", None: "unknown"}[
        ownership.creator_is_dead(info.labels)
    ]
    node = None
    if info.backend == "ray":  # imported for a ray row only: the CLI loads no backend it skips
        from runtimes.ray.cluster import NODE_ADDRESS, SESSION

        # A ray sandbox's creator is a process of its node, judged there.
        session = info.labels.get(SESSION) or session
        node = info.labels.get(NODE_ADDRESS)
    return {
        "backend": info.backend,
        "id": info.id,
        "state": info.state,
        "created": info.created,
        "session": session,
        "kept": ownership.is_kept(info.labels),
        "node": node,
        "labels": dict(info.labels),
    }


async def list_labelled(
    targets: list[RuntimeConfig | str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, str]]]:
    """Every labelled sandbox of ``targets``, their snapshots (with ``source`` and
    ``holds``), and the backends that could not be listed."""
    found: list[dict[str, Any]] = []
    snapshots: list[dict[str, Any]] = []
    unlisted: list[dict[str, str]] = []
    for target in targets:
        name = target if isinstance(target, str) else target.type
        try:
            cls, config, infos = await list_target(target)
        except SandboxError as exc:
            reason = str(exc) if str(exc) == NOT_LISTABLE else f"{type(exc).__name__}: {exc}"
            say(f"{name}: not listed ({reason})", stderr=True)
            unlisted.append({"backend": name, "error": reason})
            continue
        found += [_listed(info) for info in infos]
        try:
            taken = await cls.list_snapshots(config)
        except SandboxError as exc:
            say(f"{name}: snapshots not listed ({type(exc).__name__}: {exc})", stderr=True)
            continue
        for snap in taken:
            snapshots.append(
                {**_listed(snapshot_info(snap)), "source": snap.source, "holds": snap.holds}
            )
    return found, snapshots, unlisted


def _yes(flag: bool) -> str:
    return "yes" if flag else ""


def cmd_ls(args: argparse.Namespace) -> int:
    targets = runtime_targets(args.runtime) or list(available_runtimes())
    found, snapshots, unlisted = anyio.run(run_interruptible, lambda: list_labelled(targets))
    if args.json:
        print_json("ls", {"sandboxes": found, "snapshots": snapshots, "unlisted": unlisted})
        return 0
    headers = ["backend", "sandbox", "state", "created", "session", "kept"]
    rows = [
        [s["backend"], s["id"], s["state"], s["created"] or "", s["session"], _yes(s["kept"])]
        for s in found
    ]
    if any(s["node"] for s in found):  # ray sandboxes: the node each lives on
        headers.insert(2, "node")
        for row, s in zip(rows, found, strict=True):
            row.insert(2, s["node"] or "")
    if args.verbose:
        headers.append("labels")
        for row, s in zip(rows, found, strict=True):
            row.append(",".join(f"{k}={v}" for k, v in sorted(s["labels"].items())))
    print_table(headers, rows)
    if snapshots:
        print("\nsnapshots:")
        print_table(
            ["backend", "snapshot", "holds", "of sandbox", "created", "session", "kept"],
            [
                [
                    s["backend"],
                    s["id"],
                    s["holds"],
                    s["source"],
                    s["created"] or "",
                    s["session"],
                    _yes(s["kept"]),
                ]
                for s in snapshots
            ],
        )
    return 0


def add_cleanup_command(command: CommandFactory) -> None:
    """Register ``cleanup`` with ``build_parser``'s ``command``."""
    cleanup = command("cleanup", "remove sandboxes whose session is dead", reporting=True)
    cleanup.add_argument(
        "--runtime",
        action="append",
        help="type name or JSON config (repeatable; default: every backend)",
    )
    cleanup.add_argument(
        "--all", action="store_true", help="remove every labelled sandbox, live sessions too"
    )
    cleanup.add_argument(
        "--older-than",
        type=float,
        metavar="SECONDS",
        help="also remove sandboxes created more than SECONDS ago",
    )
    cleanup.add_argument(
        "--dry-run", action="store_true", help="report what would be removed, remove nothing"
    )
    cleanup.add_argument(
        "--kept", action="store_true", help="also remove sandboxes kept with keep=True/--keep"
    )
    cleanup.set_defaults(func=cmd_cleanup)


def add_ls_command(command: CommandFactory) -> None:
    """Register ``ls`` with ``build_parser``'s ``command``."""
    ls = command("ls", "list labelled sandboxes of every backend", reporting=True)
    ls.add_argument(
        "--runtime",
        action="append",
        help="type name or JSON config (repeatable; default: every backend)",
    )
    ls.set_defaults(func=cmd_ls)
