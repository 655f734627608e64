"""The ``mini-swe-agent`` harness: mini-SWE-agent (PyPI ``mini-swe-agent``) installed into
the sandbox and run there non-interactively, its model calls routed through the proxy.

It runs the agent's own CLI, ``mini`` (its console script under the venv's
``python -I -B -u``: nothing of the current directory on ``sys.path``), in yolo mode with
``--exit-immediately`` (no confirmation prompts, no question at the end), the built-in
``mini.yaml`` config and litellm's OpenAI-compatible provider pointed at the proxy::

    mini --yolo --exit-immediately --model openai/vf-proxy --task TASK --cost-limit 0 \\
         --output RUN_DIR/trajectory.json -c SITE_PACKAGES/minisweagent/config/mini.yaml \\
         -c model.model_kwargs.api_base="PROXY_URL" -c environment.timeout=60 ...

with ``OPENAI_API_KEY`` set to the run's proxy secret, ``MSWEA_CONFIGURED`` (skips the
first-run setup prompt), ``MSWEA_COST_TRACKING=ignore_errors`` (the proxy's model is not
in litellm's price list) and ``LITELLM_LOCAL_MODEL_COST_MAP=True`` (no download at
import). The agent runs each command in a fresh subshell in the sandbox and finishes by
running ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``; what follows that line is its
submission, which becomes ``trace.output``. The agent's trajectory file is kept in the
run directory and summarised in ``trace.metadata``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from runtimes import ExecResult, Runtime, SandboxFileNotFoundError

from .base import Budget, HarnessConfig, Trace
from .installed import AgentLaunch, InstalledConfig, InstalledHarness

__all__ = ["MiniSweAgentConfig", "MiniSweAgentHarness"]

_TRAJECTORY = "trajectory.json"
_TRAJECTORY_LIMIT = 64 * 1024 * 1024
_LOG_TAIL = 4000


class MiniSweAgentConfig(InstalledConfig):
    """Config of the ``mini-swe-agent`` harness.

    ``config_specs`` are mini's ``-c`` config files: a relative name is one of mini's
    built-in configs (``mini.yaml``, ``benchmarks/swebench.yaml``), resolved in the
    verified venv; an absolute one a sandbox path. ``overrides`` are extra
    ``key.path=value`` settings.
    ``model_retries`` is how many attempts mini makes per model call
    (``MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT``); a budget refusal stops the agent at once
    whatever it is.
    """

    id: Literal["mini-swe-agent"] = "mini-swe-agent"
    version: str = "2.4.6"
    # litellm 1.103-1.106 import the optional `mcp` package whenever tools are passed
    # (ModuleNotFoundError on every call); 1.102.4 is the newest release without that bug
    # whose dependencies the package index here can satisfy.
    extra_requirements: list[str] = Field(default_factory=lambda: ["litellm==1.102.4"])
    config_specs: list[str] = Field(default_factory=lambda: ["mini.yaml"])
    overrides: dict[str, Any] = Field(default_factory=dict)
    command_timeout: int = Field(default=60, gt=0, description="seconds per agent command")
    model_retries: int = Field(default=3, ge=1)
    model_name: str = Field(
        default="openai/vf-proxy",
        description="the model mini asks litellm for; the proxy substitutes the real one",
    )


class MiniSweAgentHarness(InstalledHarness):
    """mini-SWE-agent in the sandbox. See the module doc."""

    id = "mini-swe-agent"
    package = "mini-swe-agent"
    config_model = MiniSweAgentConfig

    def __init__(self, config: HarnessConfig | None = None):
        super().__init__(config)
        self.config: MiniSweAgentConfig

    def launch(
        self, task: str, *, base_url: str, api_key: str, run_dir: str, budget: Budget
    ) -> AgentLaunch:
        cfg = self.config
        argv = [*self.venv_entry("mini"), "--yolo", "--exit-immediately"]
        argv += ["--model", cfg.model_name, "--task", task, "--cost-limit", "0"]
        argv += ["--output", f"{run_dir}/{_TRAJECTORY}"]
        for spec in cfg.config_specs:
            argv += ["-c", self.config_path(spec)]
        settings: dict[str, Any] = {
            "model.model_kwargs.api_base": base_url,
            "environment.timeout": cfg.command_timeout,
            "agent.step_limit": 0,  # the proxy enforces the turn budget
        }
        settings.update(cfg.overrides)
        for key, value in settings.items():
            argv += ["-c", f"{key}={json.dumps(value)}"]
        env = {
            "OPENAI_API_KEY": api_key,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "MSWEA_GLOBAL_CONFIG_DIR": f"{run_dir}/config",
            "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": str(cfg.model_retries),
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "NO_COLOR": "1",
            "TERM": "dumb",
            "PYTHONUNBUFFERED": "1",
        }
        return AgentLaunch(argv=argv, env=env)

    def config_path(self, spec: str) -> str:
        """The absolute sandbox path of config file ``spec``: an absolute path as given, a
        relative one (``mini.yaml``, ``benchmarks/swebench.yaml``) in mini's built-in config
        directory of the verified venv. Never a name mini would look up in its working
        directory first (where a judge's cwd may hold a ``mini.yaml`` the policy left).
        """
        if not spec.endswith(".yaml"):
            spec += ".yaml"
        if spec.startswith("/"):
            return spec
        return f"{self.site_packages}/minisweagent/config/{spec}"

    async def collect(
        self, runtime: Runtime, run_dir: str, result: ExecResult | None, trace: Trace
    ) -> None:
        """Read the trajectory: submission -> ``trace.output``, exit status -> metadata.

        Raises:
            SandboxError: the sandbox failed while reading (typed).
        """
        if result is not None:
            trace.metadata["agent_exit_code"] = result.exit_code
            trace.metadata["agent_log_tail"] = (result.stdout + result.stderr)[-_LOG_TAIL:]
        trace.metadata["trajectory_path"] = f"{run_dir}/{_TRAJECTORY}"
        try:
            raw = await runtime.read(f"{run_dir}/{_TRAJECTORY}", max_bytes=_TRAJECTORY_LIMIT)
        except SandboxFileNotFoundError:
            if result is not None:
                trace.fail("agent_error", "mini-swe-agent wrote no trajectory")
            return
        try:
            info = json.loads(raw).get("info", {})
        except (json.JSONDecodeError, AttributeError) as exc:
            trace.fail("agent_error", f"mini-swe-agent's trajectory is not JSON: {exc}")
            return
        status = info.get("exit_status") or None
        trace.metadata["exit_status"] = status
        trace.metadata["api_calls"] = info.get("model_stats", {}).get("api_calls")
        if status == "Submitted":
            trace.output = info.get("submission", "")
        elif result is not None:
            trace.fail("agent_error", f"mini-swe-agent ended with exit status {status!r}")
