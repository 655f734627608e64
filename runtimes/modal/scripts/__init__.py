"""The ``sh`` programs the ``modal`` runtime runs inside its sandboxes, one ``.sh`` file each.

Loaded with ``runtimes.scripts.load(name, "runtimes.modal.scripts")``.
"""
