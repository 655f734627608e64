"""The POSIX ``sh`` programs the ``docker`` runtime runs in its containers, one ``.sh`` file
each, loaded with ``runtimes.scripts.load(name, "runtimes.docker.scripts")``.

Each takes its inputs as positional arguments (``sh -c SCRIPT sh ARG...``), never as text
spliced into the program.
"""
