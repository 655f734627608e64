"""vf-sandbox under the trainers' own contracts: OpenEnv sessions and TRL's ``GRPOTrainer``.

``import placement`` imports none of this. ``tools``, ``grading`` and ``host`` need only the
core dependencies; ``generation`` needs ``torch`` and ``transformers``, ``openenv`` the extra
``[openenv]``, ``trl`` the extra ``[trl]``. ``docs/trainers.md`` is the guide.

- :mod:`~placement.trainers.tools`: the sandbox tools (``bash``, ``read_file``,
  ``write_file``, and a task's own), one place where a tool call enters a sandbox.
- :mod:`~placement.trainers.grading`: a finished rollout's reward from its live sandbox,
  or *unscored*, never 0.0 for a failure of the machinery.
- :mod:`~placement.trainers.host`: the event loop on its own thread that owns the sandboxes
  (and a warm pool) of synchronous callers.
- :mod:`~placement.trainers.generation`: token-in/token-out turns from a ``transformers``
  model, for runs without an inference server (CPU).
- :mod:`~placement.trainers.openenv`: OpenEnv's ``ResourceSessionFactory`` /
  ``ResourceSession``, and a loop-owning ``TrainableSession`` over gated sessions.
- :mod:`~placement.trainers.trl`: TRL's ``rollout_func`` and ``environment_factory``.
"""
