"""A Docker config's ``build`` option: the image is built from a Dockerfile on the engine,
cached by content (an unchanged context is not rebuilt, concurrent opens build once), never
pulled; a failed step and a missing ``FROM`` image are typed errors saying what to do. And a
missing image's error says how to build it, not to pull what no registry has."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from runtimes import ProvisioningError, RuntimeConfigError, open_runtime
from runtimes.docker import build as build_module
from runtimes.docker.build_context import BUILD_LABEL, BUILD_REPOSITORY
from runtimes.docker.config import DockerConfig
from runtimes.reaper import drain_removals_blocking

from ..doc_examples import example, run_example

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


DOCKERFILE = """\
FROM vf-sandbox/base:bookworm
ARG GREETING=hello
COPY payload.txt /opt/payload.txt
RUN echo "$GREETING" > /opt/greeting
"""


@pytest.fixture
def context(tmp_path: Path, docker_client: Any) -> Iterator[Path]:
    """A tiny build context of unique content (so its first open builds); the images built
    from it are removed afterwards."""
    root = tmp_path / "ctx"
    root.mkdir()
    (root / "Dockerfile").write_text(DOCKERFILE)
    (root / "payload.txt").write_text(f"payload {uuid.uuid4().hex}\n")
    yield root
    drain_removals_blocking()  # close() removes containers in the background
    for image in docker_client.images.list(filters={"label": f"{BUILD_LABEL}.context={root}"}):
        docker_client.images.remove(image.id, force=True)


def _image_of(docker_client: Any, container_id: str | None) -> str:
    return str(docker_client.containers.get(container_id).attrs["Config"]["Image"])


async def test_a_dockerfile_is_built_once_and_an_unchanged_context_is_not_rebuilt(
    context: Path, docker_client: Any
) -> None:
    config = {"type": "docker", "build": {"context": str(context), "args": {"GREETING": "hi"}}}
    before = build_module.builds_run
    images: list[str] = []

    async def open_one() -> None:
        async with open_runtime(config) as rt:
            assert (await rt.exec(["cat", "/opt/greeting"])).stdout == "hi\n"
            assert (await rt.read("/opt/payload.txt")).startswith(b"payload ")
            images.append(_image_of(docker_client, rt.sandbox_id))

    async with anyio.create_task_group() as group:  # concurrent opens: one build
        group.start_soon(open_one)
        group.start_soon(open_one)
    assert build_module.builds_run - before == 1
    await open_one()  # unchanged context: the cached image, no build
    assert build_module.builds_run - before == 1
    assert len(set(images)) == 1 and images[0].startswith(f"{BUILD_REPOSITORY}:")
    labels = docker_client.images.get(images[0]).labels
    assert labels[f"{BUILD_LABEL}.context"] == str(context)

    (context / "payload.txt").write_text("changed\n")  # new content: a new image
    async with open_runtime(config) as rt:
        assert await rt.read("/opt/payload.txt") == b"changed\n"
        assert _image_of(docker_client, rt.sandbox_id) != images[0]
    assert build_module.builds_run - before == 2


async def test_image_naming_a_dockerfile_builds_it_as_modal_does(
    context: Path, docker_client: Any
) -> None:
    """``image="dir/Dockerfile"`` is the Modal runtime's spelling: the same config opens on
    both backends (here: the directory is the context, default args)."""
    config = DockerConfig.model_validate({"image": str(context / "Dockerfile")})
    assert config.build is not None and config.build.context == str(context)
    async with open_runtime(config) as rt:
        assert (await rt.exec(["cat", "/opt/greeting"])).stdout == "hello\n"


async def test_a_failed_step_is_a_provisioning_error_quoting_its_last_lines(
    context: Path,
) -> None:
    (context / "Dockerfile").write_text(
        "FROM vf-sandbox/base:bookworm\nRUN echo step-output-marker && exit 3\n"
    )
    runtime = open_runtime({"type": "docker", "build": {"context": str(context)}})
    with pytest.raises(ProvisioningError) as caught:
        await runtime.start()
    message = str(caught.value)
    assert "step-output-marker" in message and "returned a non-zero code: 3" in message
    assert runtime.sandbox_id is None


async def test_a_missing_from_image_says_how_to_build_it_and_is_never_pulled(
    context: Path,
) -> None:
    (context / "Dockerfile").write_text("FROM vf-sandbox/not-built-here:latest\nRUN true\n")
    before = build_module.builds_run
    runtime = open_runtime({"type": "docker", "build": {"context": str(context)}})
    with pytest.raises(ProvisioningError, match="vf-sandbox/not-built-here:latest") as caught:
        await runtime.start()
    assert "make images" in str(caught.value) and "builds never pull" in str(caught.value)
    assert build_module.builds_run == before, "refused before the engine was asked to build"


async def test_a_missing_project_image_says_make_images_not_pull() -> None:
    runtime = open_runtime({"type": "docker", "image": "vf-sandbox/not-built-here:latest"})
    with pytest.raises(ProvisioningError, match="make images") as caught:
        await runtime.start()
    assert "pull='missing'" not in str(caught.value) and "build" in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"image": "python:3.11", "build": {"context": "."}}, "image and build exclude"),
        ({"pull": "missing", "build": {"context": "."}}, "build never pulls"),
        ({"container": "c1", "build": {"context": "."}}, "not to an attached container"),
        ({"build": {"context": ".", "dockerfile": "../Dockerfile"}}, "inside the build context"),
        ({"build": {"context": ".", "args": {"A-B": "1"}}}, "not a build arg name"),
        ({"build": {"context": ".", "max_context": "lots"}}, "max_context must be"),
        ({"build": {"contxt": "."}}, "contxt"),
    ],
)
def test_build_options_are_validated(fields: dict[str, Any], expected: str) -> None:
    with pytest.raises(RuntimeConfigError, match=expected):
        open_runtime({"type": "docker", **fields})


def test_the_docs_example_runs_as_it_stands(docker_client: Any, tmp_path: Path) -> None:
    """docs/docker.md's ``build`` example, run as a script: it prints what the page shows."""
    code, shown = example("docs/docker.md", "## Building images from a Dockerfile")
    try:
        assert run_example(code, tmp_path) == shown
    finally:
        for image in docker_client.images.list(filters={"label": BUILD_LABEL}):
            if "vf-build-doc-" in image.labels.get(f"{BUILD_LABEL}.context", ""):
                docker_client.images.remove(image.id, force=True)
