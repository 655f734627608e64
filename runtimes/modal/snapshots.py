"""Snapshots of Modal sandboxes: ``Sandbox.snapshot_filesystem()`` gives an Image; a fork is a
sandbox created with ``image=Image.from_id(...)``.

Modal keeps no labels on images, so each snapshot is recorded in a Modal Dict of the app's
environment (``<app_name>-snapshots``: image id -> the snapshot's labels), which ``vf-sandbox
ls`` / ``cleanup`` read. The image itself expires after ``snapshot_ttl`` seconds whatever
happens (a holder killed before anything could record or remove it leaks nothing for long);
the record is written right after the snapshot, and an image whose record could not be
written is deleted again.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from typing import Any

from .. import ownership
from ..errors import ProvisioningError
from ..snapshot import SandboxSnapshot, SnapshotNotFoundError, snapshot_from_labels
from . import client
from .client import run_bounded_at_exit, sdk_call, sdk_collect, sweep_calls
from .config import ModalConfig


def snapshot_dict_name(cfg: ModalConfig) -> str:
    """The Modal Dict recording the snapshots of ``cfg``'s app."""
    return f"{cfg.app_name}-snapshots"[:64]


def _records(modal: Any, cfg: ModalConfig, *, create: bool) -> Any:
    return modal.Dict.from_name(
        snapshot_dict_name(cfg), environment_name=cfg.environment, create_if_missing=create
    )


def experimental(modal: Any) -> Any:
    """``modal.experimental`` (its ``image_delete``): an attribute of a fake SDK, a submodule
    to import of the real one."""
    found = getattr(modal, "experimental", None)
    return found if found is not None else importlib.import_module(f"{modal.__name__}.experimental")


async def record_snapshot(cfg: ModalConfig, image_id: str, labels: dict[str, str]) -> None:
    """Write the snapshot's record.

    Raises:
        SandboxTransportError: Modal could not be reached.
        SandboxError: Modal refused.
    """
    modal = client.modal_sdk()
    with sweep_calls(f"record snapshot {image_id}"):
        await sdk_call(_records(modal, cfg, create=True).put, image_id, json.dumps(labels))


async def fork_image(cfg: ModalConfig, snapshot: SandboxSnapshot) -> Any:
    """The Image a fork of ``snapshot`` is created from, once Modal showed it exists.

    Raises:
        SnapshotNotFoundError: Modal has no such image (deleted, or expired after its ttl).
        ProvisioningError: Modal could not be asked.
    """
    modal = client.modal_sdk()
    image = modal.Image.from_id(snapshot.id)
    try:
        await sdk_call(image.hydrate)
    except modal.exception.NotFoundError as exc:
        raise SnapshotNotFoundError(f"{snapshot.describe()} is gone from Modal: {exc}") from None
    except Exception as exc:
        raise ProvisioningError(
            f"cannot look up the image of {snapshot.describe()}: {type(exc).__name__}: {exc}"
        ) from exc
    return image


async def list_recorded(cfg: ModalConfig) -> list[SandboxSnapshot]:
    """The snapshots recorded for ``cfg``'s app (none without credentials: not contacted).

    Raises:
        SandboxTransportError: Modal could not be reached.
        SandboxError: Modal refused the listing.
    """
    modal = client.modal_sdk()
    if not modal.config.config.get("token_id"):
        return []
    with sweep_calls("list snapshots"):
        try:
            items = await sdk_collect(_records(modal, cfg, create=False).items)
        except modal.exception.NotFoundError:
            return []  # no record was ever written
    found = []
    for image_id, value in items:
        try:
            labels = {str(k): str(v) for k, v in dict(json.loads(value)).items()}
        except (TypeError, ValueError):
            continue
        if labels.get(ownership.BACKEND) == "modal":
            found.append(snapshot_from_labels("modal", str(image_id), labels, "filesystem"))
    return found


async def delete_recorded(cfg: ModalConfig, snapshot: SandboxSnapshot) -> None:
    """Delete a recorded snapshot's image, then its record; one not recorded (removed already,
    or never one of ours) is left alone.

    Raises:
        SandboxTransportError: Modal could not be reached.
        SandboxError: Modal refused.
    """
    modal = client.modal_sdk()
    errors = modal.exception
    records = _records(modal, cfg, create=False)
    with sweep_calls(f"delete snapshot {snapshot.id}"):
        try:
            if await sdk_call(records.get, snapshot.id) is None:
                return
            with contextlib.suppress(errors.NotFoundError):  # expired already
                await sdk_call(experimental(modal).image_delete, snapshot.id)
            await sdk_call(records.pop, snapshot.id, None)
        except errors.NotFoundError:
            return  # no record was ever written


def delete_recorded_blocking(cfg: ModalConfig, snapshot: SandboxSnapshot) -> None:
    """:func:`delete_recorded` through the SDK's blocking interface, in a thread, bounded (the
    exit backstop).

    Raises:
        SandboxError: the deletion failed or did not answer in time.
    """

    def delete() -> None:
        modal = client.modal_sdk()
        try:
            records = _records(modal, cfg, create=False)
            if records.get(snapshot.id) is not None:
                with contextlib.suppress(modal.exception.NotFoundError):
                    experimental(modal).image_delete(snapshot.id)
                records.pop(snapshot.id, None)
        except modal.exception.NotFoundError:
            return

    run_bounded_at_exit(
        delete, f"removing {snapshot.describe()} at exit", "vf-modal-snapshot-atexit"
    )
