"""pytest fixtures for users' own environment tests (registered through ``pytest11``).

``sandbox_factory`` opens runtimes from any config and closes them after the test::

    def test_my_env(sandbox_factory):
        async def body():
            async with sandbox_factory({"type": "subprocess"}) as rt:
                assert (await rt.exec(["true"])).ok
        anyio.run(body)

Docker fixtures (need a reachable engine; the test is skipped when none answers -- or
failed, with ``vf_sandbox_require_docker = true`` in the pytest ini options, as this
project's own suite sets -- and failed when the image is missing; images are never pulled):

* ``docker_runtime_factory(image=..., **fields)`` -- an unstarted :class:`DockerRuntime`
  owning a fresh container; whatever the test left open is closed afterwards.
* ``attached_container`` -- a running container started with testcontainers'
  ``DockerContainer`` (Ryuk disabled: the project sweeps its own labels), removed after
  the test; ``attached_container_config`` is a ``DockerConfig`` in attach mode on it and
  ``attached_container_runtime`` an unstarted runtime on that config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import anyio
import pytest

from .base import Runtime
from .config import RuntimeConfig
from .lifecycle import State
from .registry import open_runtime

if TYPE_CHECKING:
    from .docker import DockerConfig, DockerRuntime

RuntimeFactory = Callable[[RuntimeConfig | Mapping[str, Any] | str], Runtime]
DockerRuntimeFactory = Callable[..., "DockerRuntime"]

DOCKER_TEST_IMAGE = "vf-sandbox/base:bookworm"
_KEEP_ALIVE = "sh -c 'trap \"exit 0\" TERM; while :; do sleep 3600 & wait $!; done'"


@pytest.fixture
def sandbox_factory() -> Iterator[RuntimeFactory]:
    """A function that returns an unstarted runtime; use it with ``async with``."""
    made: list[Runtime] = []

    def factory(config: RuntimeConfig | Mapping[str, Any] | str) -> Runtime:
        runtime = open_runtime(config)
        made.append(runtime)
        return runtime

    yield factory
    leaked = [rt.describe() for rt in made if rt.state not in (State.NEW, State.CLOSED)]
    assert not leaked, f"runtimes left open by the test: {leaked}"


# ---------------------------------------------------------------------- docker

_REQUIRE_DOCKER = "vf_sandbox_require_docker"
_docker_required = False


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        _REQUIRE_DOCKER,
        "fail (instead of skip) Docker tests when no engine or SDK is available",
        type="bool",
        default=False,
    )


def pytest_configure(config: pytest.Config) -> None:
    global _docker_required
    _docker_required = bool(config.getini(_REQUIRE_DOCKER))


def _no_docker(reason: str) -> NoReturn:
    if _docker_required:
        pytest.fail(f"{reason} ({_REQUIRE_DOCKER} is set: `make test` brings the engine up)")
    pytest.skip(reason)


def _require_docker_image(image: str) -> None:
    """Skip (or fail, see ``vf_sandbox_require_docker``) when no engine answers; fail when
    the image is missing (never pulled)."""
    try:
        import docker
        import docker.errors
    except ImportError:
        _no_docker("the docker SDK is not installed (pip install 'vf-sandbox[docker]')")
    try:
        client = docker.from_env(timeout=10)
    except docker.errors.DockerException as exc:
        _no_docker(f"no Docker engine answers: {exc}")
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        pytest.fail(f"docker image {image!r} is missing: build it first (make images)")
    finally:
        client.close()


def _close_all(runtimes: list[Runtime]) -> None:
    for runtime in runtimes:
        if not runtime.closed:
            anyio.run(runtime.close)


@pytest.fixture
def docker_runtime_factory() -> Iterator[DockerRuntimeFactory]:
    """``factory(image=..., **config_fields)`` -> an unstarted DockerRuntime.

    Use it with ``async with``; runtimes the test left open are closed (their containers
    removed) after the test.
    """
    from .docker import DockerConfig, DockerRuntime

    made: list[Runtime] = []
    checked: set[str] = set()

    def factory(image: str = DOCKER_TEST_IMAGE, **fields: Any) -> DockerRuntime:
        if image not in checked:
            _require_docker_image(image)
            checked.add(image)
        runtime = DockerRuntime(DockerConfig(image=image, **fields))
        made.append(runtime)
        return runtime

    try:
        yield factory
    finally:
        _close_all(made)


@pytest.fixture
def attached_container() -> Iterator[Any]:
    """A running ``vf-sandbox/base:bookworm`` container (testcontainers), removed afterwards.

    It keeps itself alive with a shell loop and has no network; its working directory is
    ``/srv``.
    """
    _require_docker_image(DOCKER_TEST_IMAGE)
    from testcontainers.core.config import testcontainers_config
    from testcontainers.core.container import DockerContainer

    testcontainers_config.ryuk_disabled = True
    container = (
        DockerContainer(DOCKER_TEST_IMAGE)
        .with_command(_KEEP_ALIVE)
        .with_kwargs(network_mode="none", init=True, working_dir="/srv")
    )
    container.start()
    try:
        yield container
    finally:
        container.stop()


@pytest.fixture
def attached_container_config(attached_container: Any) -> DockerConfig:
    """A ``DockerConfig`` in attach mode on :func:`attached_container`."""
    from .docker import DockerConfig

    return DockerConfig(container=attached_container.get_wrapped_container().id)


@pytest.fixture
def attached_container_runtime(attached_container_config: DockerConfig) -> Iterator[DockerRuntime]:
    """An unstarted DockerRuntime attached to :func:`attached_container`.

    Closing it leaves the container running; the fixture removes the container afterwards.
    """
    from .docker import DockerRuntime

    runtime = DockerRuntime(attached_container_config)
    try:
        yield runtime
    finally:
        _close_all([runtime])
