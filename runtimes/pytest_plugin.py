"""pytest fixtures for users' own environment tests (registered through ``pytest11``).

``sandbox_factory`` opens runtimes from any config; use each with ``async with``::

    def test_my_env(sandbox_factory):
        async def body():
            async with sandbox_factory({"type": "subprocess"}) as rt:
                assert (await rt.exec(["true"])).ok
        anyio.run(body)

A runtime the test left open is closed after it, and the test fails (in teardown) naming it.

Docker fixtures (need a reachable engine; the test is skipped when none answers -- or
failed, with ``vf_sandbox_require_docker = true`` in the pytest ini options, as this
project's own suite sets -- and failed when the image is missing, with a message that says
how to get it; the fixtures never pull, a config with ``pull="missing"`` or ``"always"`` does):

* ``docker_runtime_factory(image=..., **fields)`` -- an unstarted :class:`DockerRuntime`
  owning a fresh container; whatever the test left open is closed afterwards.
* ``attached_container`` -- a running container started with testcontainers'
  ``DockerContainer`` (Ryuk disabled: the project sweeps its own labels), removed after
  the test; ``attached_container_config`` is a ``DockerConfig`` in attach mode on it and
  ``attached_container_runtime`` an unstarted runtime on that config: open it in the test
  with ``async with attached_container_runtime as rt:`` (an operation before that raises
  :class:`~runtimes.errors.SandboxUnavailableError` saying so). The fixtures are plain
  functions so that they work under any async test plugin (anyio, pytest-asyncio, trio):
  a runtime started in a fixture's own event loop could not be used from the test's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn, cast

import anyio
import pytest

from .base import Runtime
from .config import RuntimeConfig
from .errors import SandboxError
from .lifecycle import State
from .registry import open_runtime, resolve_runtime_config

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
    leaked = [rt for rt in made if rt.state not in (State.NEW, State.CLOSED)]
    if leaked:
        pytest.fail(_leak_message(leaked, _close_all(leaked)), pytrace=False)


def _leak_message(leaked: list[Runtime], close_errors: list[str]) -> str:
    names = ", ".join(rt.describe() for rt in leaked)
    closed = "closing it also failed" if close_errors else "the fixture closed it"
    message = (
        f"sandbox_factory: the test left {len(leaked)} runtime(s) open: {names}; {closed}. "
        "Open them with `async with sandbox_factory(config) as rt:` (or `await rt.close()`) "
        "so each sandbox is removed when the test ends."
    )
    if close_errors:
        message += "\n" + "\n".join(close_errors)
    return message


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
        pytest.fail(
            f"{reason}\n(Docker tests fail instead of skipping: {_REQUIRE_DOCKER} = true "
            "is set in the pytest ini options)",
            pytrace=False,
        )
    pytest.skip(reason)


def missing_image_message(image: str) -> str:
    if image == DOCKER_TEST_IMAGE:
        how = (
            "it is vf-sandbox's offline Debian base image: build it from a vf-sandbox source "
            "checkout with `bash images/build-base.sh` (debootstraps Debian bookworm from your "
            "apt mirror, no registry needed), or give the fixture an image you have: "
            "docker_runtime_factory(image=...)"
        )
    elif image.startswith("vf-sandbox/"):
        how = (
            "vf-sandbox's images are in no registry: build them from a vf-sandbox source "
            "checkout with `make images` (images/<name>/Dockerfile, on the offline base image), "
            "or give the fixture an image you have: docker_runtime_factory(image=...)"
        )
    else:
        how = (
            f"pull it (`docker pull {image}`), build it (`docker build -t {image} ...`), or "
            "pass pull='missing' to docker_runtime_factory to let the runtime pull it"
        )
    return f"Docker image {image!r} is not on this engine and the fixture does not pull it: {how}"


def require_docker_image(image: str, base_url: str | None = None) -> None:
    """Skip (or fail, see ``vf_sandbox_require_docker``) when no engine answers; fail when
    the image is missing (never pulled). Failures carry a message, not a traceback."""
    present = _image_present(image, base_url)
    if isinstance(present, str):
        _no_docker(present)
    if not present:
        pytest.fail(missing_image_message(image), pytrace=False)


def _image_present(image: str, base_url: str | None) -> bool | str:
    """Whether the engine has ``image``, or (a string) why no engine answered."""
    try:
        import docker
        import docker.errors
        import requests
    except ImportError:
        return "the docker SDK is not installed: pip install 'vf-sandbox[docker]'"
    where = base_url or os.environ.get("DOCKER_HOST") or "the default socket"
    try:
        if base_url:
            client = docker.DockerClient(base_url=base_url, timeout=10)
        else:
            client = docker.from_env(timeout=10)
    except docker.errors.DockerException as exc:
        return f"no Docker engine answers at {where}: {exc}"
    try:
        client.images.get(image)
    except docker.errors.ImageNotFound:
        return False
    except (docker.errors.DockerException, requests.RequestException) as exc:
        return f"the Docker engine at {where} failed to answer: {exc}"
    finally:
        client.close()
    return True


def _close_all(runtimes: list[Runtime]) -> list[str]:
    """Close every runtime still open; the errors of those that would not close."""
    errors = []
    for runtime in runtimes:
        if not runtime.closed:
            try:
                anyio.run(runtime.close)
            except SandboxError as exc:
                errors.append(f"{runtime.describe()}: {type(exc).__name__}: {exc}")
    return errors


@pytest.fixture
def docker_runtime_factory() -> Iterator[DockerRuntimeFactory]:
    """``factory(image=..., **config_fields)`` -> an unstarted DockerRuntime.

    Use it with ``async with``; runtimes the test left open are closed (their containers
    removed) after the test.
    """
    from .docker import DockerRuntime

    made: list[Runtime] = []
    checked: set[str] = set()

    def factory(image: str = DOCKER_TEST_IMAGE, **fields: Any) -> DockerRuntime:
        if image not in checked and fields.get("pull", "never") == "never":
            require_docker_image(image, fields.get("base_url"))
            checked.add(image)
        config = resolve_runtime_config({**fields, "type": "docker", "image": image})
        runtime = DockerRuntime(cast("DockerConfig", config))
        made.append(runtime)
        return runtime

    yield factory
    _fail_on_close_errors("docker_runtime_factory", _close_all(made))


def _fail_on_close_errors(fixture: str, errors: list[str]) -> None:
    if errors:
        pytest.fail(f"{fixture}: closing failed:\n" + "\n".join(errors), pytrace=False)


@pytest.fixture
def attached_container() -> Iterator[Any]:
    """A running ``vf-sandbox/base:bookworm`` container (testcontainers), removed afterwards.

    It keeps itself alive with a shell loop and has no network; its working directory is
    ``/srv``.
    """
    require_docker_image(DOCKER_TEST_IMAGE)
    try:
        from testcontainers.core.config import testcontainers_config
        from testcontainers.core.container import DockerContainer
    except ImportError:
        pytest.fail("attached_container needs testcontainers: pip install testcontainers", False)

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
    """An unstarted DockerRuntime attached to :func:`attached_container`: open it in the
    test with ``async with attached_container_runtime as rt:`` (using it before raises
    ``SandboxUnavailableError`` saying so; a fixture cannot start it for the test's event
    loop, whichever async plugin runs it).

    Closing it leaves the container running; the fixture removes the container afterwards.
    """
    from .docker import DockerRuntime

    runtime = DockerRuntime(attached_container_config)
    yield runtime
    _fail_on_close_errors("attached_container_runtime", _close_all([runtime]))
