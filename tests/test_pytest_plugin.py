"""The `vf_sandbox` pytest plugin, as a user's suite meets it (run by pytester in a subprocess):
failures say what is wrong and what to do, in a few lines, and a leaked sandbox is closed."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from runtimes.pytest_plugin import DOCKER_TEST_IMAGE, missing_image_message

pytest_plugins = ["pytester"]

MISSING_IMAGE = "vf-sandbox-test/no-such-image:1"
NO_ENGINE = "unix:///nonexistent/vf-sandbox-test.sock"


def _run(pytester: pytest.Pytester, source: str, ini: str = "") -> pytest.RunResult:
    pytester.makepyfile(test_user_suite=textwrap.dedent(source))
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-rA", timeout=300)


def _assert_no_traceback(result: pytest.RunResult) -> None:
    out = result.stdout.str()
    for noise in ("Traceback", "During handling of the above exception", "site-packages/docker"):
        assert noise not in out, out
    assert len(result.stdout.lines) < 40, out


def test_sandbox_factory_closes_a_leaked_sandbox_and_fails(
    pytester: pytest.Pytester, tmp_path: Path
) -> None:
    """The leaking test errors in teardown naming the sandbox; by the next test the sandbox's
    directory and its background process are gone (not only at interpreter exit)."""
    root = tmp_path / "boxes"
    result = _run(
        pytester,
        f"""
        import os, subprocess, anyio

        ROOT = {str(root)!r}

        def test_leaks(sandbox_factory):
            rt = sandbox_factory({{"type": "subprocess", "root": ROOT}})

            async def body():
                await rt.start()
                await rt.exec(["sh", "-c", "nohup sleep 413.1414 >/dev/null 2>&1 &"])

            anyio.run(body)
            with open(os.path.join(ROOT, "leaked-id"), "w") as fh:
                fh.write(rt.sandbox_id)

        def test_next():
            with open(os.path.join(ROOT, "leaked-id")) as fh:
                leaked = fh.read()
            assert leaked and not os.path.exists(os.path.join(ROOT, leaked))
            ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
            assert "413.1414" not in ps
        """,
    )
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            "*sandbox_factory: the test left 1 runtime(s) open: subprocess sandbox sbx-*; "
            "the fixture closed it. Open them with `async with sandbox_factory(config) as rt:`*",
        ]
    )
    _assert_no_traceback(result)


def test_sandbox_factory_quiet_when_closed(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        """
        import anyio

        def test_closed(sandbox_factory):
            async def body():
                async with sandbox_factory("subprocess") as rt:
                    assert (await rt.exec(["true"])).ok
                sandbox_factory("subprocess")  # never started: nothing to close

            anyio.run(body)
        """,
    )
    result.assert_outcomes(passed=1)


@pytest.mark.docker
def test_missing_image_says_how_to_get_it(pytester: pytest.Pytester) -> None:
    result = _run(
        pytester,
        f"""
        def test_needs_image(docker_runtime_factory):
            docker_runtime_factory(image={MISSING_IMAGE!r})
        """,
    )
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            f"*Docker image '{MISSING_IMAGE}' is not on this engine and the fixture does not "
            f"pull it: pull it (`docker pull {MISSING_IMAGE}`), build it*pull='missing'*",
        ]
    )
    assert "make images" not in result.stdout.str()
    _assert_no_traceback(result)


def test_missing_base_image_says_how_to_build_it() -> None:
    message = missing_image_message(DOCKER_TEST_IMAGE)
    assert "images/build-base.sh" in message and "docker_runtime_factory(image=" in message
    assert "make" not in message


def test_no_engine_skips_or_fails_with_a_message(pytester: pytest.Pytester) -> None:
    source = f"""
        def test_needs_engine(docker_runtime_factory):
            docker_runtime_factory(base_url={NO_ENGINE!r})
        """
    skipped = _run(pytester, source)
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines([f"SKIPPED*no Docker engine answers at {NO_ENGINE}*"])

    failed = _run(pytester, source, ini="vf_sandbox_require_docker = true")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(
        [
            f"*no Docker engine answers at {NO_ENGINE}*",
            "*Docker tests fail instead of skipping: vf_sandbox_require_docker = true is set*",
        ]
    )
    assert "make test" not in failed.stdout.str()
    _assert_no_traceback(failed)


def test_missing_project_image_says_make_images_not_pull() -> None:
    message = missing_image_message("vf-sandbox/python:latest")
    assert "make images" in message and "docker pull" not in message


def test_attached_container_runtime_used_unstarted_says_how_to_open_it(
    pytester: pytest.Pytester,
) -> None:
    """The fixture hands out an unstarted runtime (it cannot start one for the test's event
    loop); using it as if started fails with a message that says how to open it."""
    result = _run(
        pytester,
        """
        import anyio

        def test_forgot_to_open(attached_container_runtime):
            async def body():
                await attached_container_runtime.exec(["true"])
            anyio.run(body)

        def test_opened(attached_container_runtime):
            async def body():
                async with attached_container_runtime as rt:
                    assert (await rt.exec(["pwd"])).stdout == "/srv\\n"
            anyio.run(body)
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["*was never started: open it first, with `async with runtime as rt:`*"]
    )
