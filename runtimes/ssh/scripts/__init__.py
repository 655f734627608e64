"""The POSIX ``sh`` programs the ``ssh`` runtime runs on a control channel, one ``.sh`` file each.

Loaded with ``runtimes.scripts.load(name, __name__)``; each takes its inputs as positional
arguments (see the comment at the top of each file), never as text pasted into the program.
"""
