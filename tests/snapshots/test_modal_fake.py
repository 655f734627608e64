"""Modal snapshots against the fake SDK: the fake's ``snapshot_filesystem`` is the SDK's own
request path and its answers have the SDK's types (so the runtime's use of it is what real Modal
would see), the records that list snapshots, and the image's ttl."""

from __future__ import annotations

import types

import modal
import modal.exception as modal_exc
import pytest

from runtimes import open_runtime, remove_snapshot
from runtimes.modal import ModalConfig, ModalRuntime
from runtimes.modal.snapshots import snapshot_dict_name
from tests.modal.fake_modal import FakeModalService
from tests.modal.sdk_scenarios import SCENARIO_APP
from tests.modal.support import fake_config

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


async def test_the_fake_snapshot_is_the_sdks_own_call_and_type(
    modal_fake: types.ModuleType, fake_service: FakeModalService
) -> None:
    app = await modal_fake.App.lookup.aio(SCENARIO_APP, create_if_missing=True)
    source = await modal_fake.Sandbox.create.aio(app=app)
    try:
        done = await source.exec.aio("sh", "-c", "echo kept > /tmp/file")
        assert await done.wait.aio() == 0
        with pytest.raises(modal_exc.InvalidError, match="ttl"):
            await source.snapshot_filesystem.aio(ttl=0)  # the SDK's own validation
        image = await source.snapshot_filesystem.aio(ttl=600)
        assert isinstance(image, modal.Image) and image.object_id.startswith("im-")
        for given in (image, modal_fake.Image.from_id(image.object_id)):
            fork = await modal_fake.Sandbox.create.aio(app=app, image=given)
            try:
                read = await fork.exec.aio("cat", "/tmp/file")
                assert await read.stdout.read.aio() == "kept\n"
            finally:
                await fork.terminate.aio()
        await modal_fake.experimental.image_delete.aio(image.object_id)
        with pytest.raises(modal_exc.NotFoundError):
            await modal_fake.Image.from_id(image.object_id).hydrate.aio()
        with pytest.raises(modal_exc.NotFoundError):
            await modal_fake.experimental.image_delete.aio(image.object_id)
    finally:
        await source.terminate.aio()


async def test_a_snapshot_is_recorded_with_its_labels_and_ttl(
    modal_fake: types.ModuleType, fake_service: FakeModalService
) -> None:
    config = ModalConfig(**fake_config(snapshot_ttl=3600))
    async with open_runtime(config) as source:
        snap = await source.snapshot(labels={"team": "rl"})
    try:
        assert fake_service._read_json("images.json")[snap.id]["ttl"] == 3600
        records = modal_fake.Dict.from_name(snapshot_dict_name(config))
        recorded = [key async for key, _ in records.items.aio()]
        assert recorded == [snap.id]
        listed = await ModalRuntime.list_snapshots(config)
        assert [(s.id, s.labels["team"], s.source) for s in listed] == [
            (snap.id, "rl", snap.source)
        ]
    finally:
        await remove_snapshot(snap)
    assert await ModalRuntime.list_snapshots(config) == []
    assert snap.id not in fake_service._read_json("images.json")


async def test_listing_without_credentials_contacts_nothing(
    modal_fake: types.ModuleType, fake_service: FakeModalService
) -> None:
    modal_fake.config = types.SimpleNamespace(config={})
    assert await ModalRuntime.list_snapshots(ModalConfig(**fake_config())) == []
    assert not (fake_service.state_dir / "dicts.json").exists()


async def test_an_image_id_never_recorded_is_not_deleted(
    modal_fake: types.ModuleType, fake_service: FakeModalService
) -> None:
    config = ModalConfig(**fake_config())
    async with open_runtime(config) as source:
        snap = await source.snapshot()
    stranger = snap.model_copy(update={"id": "im-notoneofours0000000"})
    await remove_snapshot(stranger, config)  # not recorded: left alone, no error
    assert [s.id for s in await ModalRuntime.list_snapshots(config)] == [snap.id]
    await remove_snapshot(snap)
