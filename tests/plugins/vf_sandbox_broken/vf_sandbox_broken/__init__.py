"""A plugin that fails on import, to prove one broken plugin breaks nothing else."""

raise RuntimeError("vf_sandbox_broken: simulated import failure (missing native library)")
