"""A real inspect ``eval()`` through the ``vf`` provider: a one-sample task whose scripted
model (``mockllm/model``) calls inspect's own ``bash()`` and ``python()`` tools, and a scorer
that reads what they left in the sandbox. On Docker (the issue's case) and on the subprocess
runtime from a config file beside the task, found the way inspect finds a provider's files."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import docker
import pytest
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog
from inspect_ai.model import ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import bash, python
from inspect_ai.util import sandbox

from runtimes.inspect_sandbox import INSPECT_LABEL, TASK_LABEL, VfSandboxEnvironment
from runtimes.reaper import drain_removals_blocking

IMAGE = "vf-sandbox/base:bookworm"
MODEL = "mockllm/model"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def scripted_model() -> Any:
    """Writes the answer with bash, reads it back with python, then says it. Each output
    carries its usage: without it mockllm counts tokens with tiktoken, which downloads its
    encoding from the internet (``no_internet`` makes sure nothing does)."""
    usage = ModelUsage(input_tokens=10, output_tokens=10, total_tokens=20)
    outputs = [
        ModelOutput.for_tool_call(
            MODEL, "bash", {"command": "mkdir -p out && echo $((6 * 7)) > out/answer.txt"}
        ),
        ModelOutput.for_tool_call(
            MODEL, "python", {"code": "print('read:', open('out/answer.txt').read().strip())"}
        ),
        ModelOutput.from_content(MODEL, "The answer is 42."),
    ]
    for output in outputs:
        output.usage = usage
    return get_model(MODEL, custom_outputs=outputs)


@pytest.fixture(autouse=True)
def no_internet(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests talk to loopback and their own sandboxes only: a tokenizer download fails."""
    import tiktoken.load

    def refuse(blobpath: str) -> bytes:
        raise AssertionError(f"the eval tried to download {blobpath}")

    monkeypatch.setattr(tiktoken.load, "read_file", refuse)


@scorer(metrics=[accuracy()])
def answer_file() -> Scorer:
    """CORRECT when the sandbox's out/answer.txt holds the target and the model said it."""

    async def score(state: TaskState, target: Target) -> Score:
        env = sandbox()
        written = (await env.read_file("out/answer.txt")).strip()
        said = target.text in state.output.completion
        value = CORRECT if written == target.text and said else INCORRECT
        labels = env.as_type(VfSandboxEnvironment).runtime.config.labels
        return Score(
            value=value,
            answer=written,
            explanation=state.output.completion,
            metadata={"task_label": labels[TASK_LABEL]},
        )

    return score


def task(sandbox_spec: Any, name: str | None = None) -> Task:
    return Task(
        name=name,
        dataset=[Sample(input="What is 6 times 7? Leave it in out/answer.txt.", target="42")],
        solver=[use_tools([bash(timeout=30), python(timeout=30)]), generate()],
        scorer=answer_file(),
        sandbox=sandbox_spec,
    )


def run(sandbox_spec: Any, log_dir: Path, name: str | None = None) -> EvalLog:
    [log] = eval(
        task(sandbox_spec, name),
        model=scripted_model(),
        log_dir=str(log_dir),
        display="none",
        max_samples=1,
    )
    return log


def assert_scored_correct(log: EvalLog) -> None:
    assert log.status == "success", log.error
    assert log.results is not None
    [sample] = log.samples or []
    assert sample.scores is not None
    assert sample.scores["answer_file"].value == CORRECT
    assert log.results.scores[0].metrics["accuracy"].value == 1.0
    tool_outputs = [m.text for m in sample.messages if m.role == "tool"]
    assert tool_outputs[1].strip() == "read: 42", tool_outputs


def inspect_containers(client: docker.DockerClient, task_name: str) -> list[Any]:
    """The containers of this eval's task: other tests' evals run beside it."""
    labels = [f"{INSPECT_LABEL}=true", f"{TASK_LABEL}={task_name}"]
    return client.containers.list(all=True, filters={"label": labels})


@pytest.mark.docker
def test_an_eval_with_bash_and_python_tools_scores_on_docker(tmp_path: Path) -> None:
    client = docker.from_env()
    name = f"docker_tools_{uuid.uuid4().hex[:8]}"
    before = {c.id for c in inspect_containers(client, name)}
    log = run(("vf", {"type": "docker", "image": IMAGE}), tmp_path / "logs", name)
    assert_scored_correct(log)
    assert log.eval.sandbox is not None and log.eval.sandbox.type == "vf"
    [sample] = log.samples or []
    assert sample.scores is not None
    assert sample.scores["answer_file"].metadata == {"task_label": name}, "counted by this label"
    drain_removals_blocking()
    left = [c for c in inspect_containers(client, name) if c.id not in before]
    assert left == [], "the sample's container outlived the eval"


def test_an_eval_finds_its_config_file_beside_the_task(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sandbox="vf"`` with a ``vf-sandbox.yaml`` in the task's directory uses that file: here
    a subprocess sandbox in a workdir the file names, where the tools' answer stays."""
    workdir = tmp_path / "work"
    workdir.mkdir()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vf-sandbox.yaml").write_text(f"type: subprocess\nworkdir: {workdir}\n")
    log = run("vf", tmp_path / "logs")
    assert_scored_correct(log)
    assert log.eval.sandbox is not None and log.eval.sandbox.config == "vf-sandbox.yaml"
    assert (workdir / "out" / "answer.txt").read_text() == "42\n"


@pytest.mark.anyio
async def test_sandboxes_are_labelled_with_the_inspect_task() -> None:
    envs = await VfSandboxEnvironment.sample_init("my_task", None, {})
    runtime = envs["default"].as_type(VfSandboxEnvironment).runtime
    try:
        labels = dict(runtime.config.labels)
    finally:
        await VfSandboxEnvironment.sample_cleanup("my_task", None, envs, False)
    assert labels[INSPECT_LABEL] == "true"
    assert labels[TASK_LABEL] == "my_task"
    assert runtime.closed
