"""The ``modal`` runtime: sandboxes that are Modal Sandboxes, driven through the ``modal`` SDK.

Written against ``modal`` 1.6 (``Sandbox.create``, ``Sandbox.exec``, ``Sandbox.filesystem``,
``Sandbox.list``), always through the SDK's async interface (the ``.aio`` variants) when
the caller runs on asyncio. The SDK's ``.aio`` variants only work on an asyncio loop; under
trio every SDK call goes to a worker thread through the SDK's blocking interface instead.

What Modal's transport limits, and how this package works around it:

* **argv**: the SDK refuses an ``exec`` whose arguments total more than 65,536 characters
  (``ARG_MAX_BYTES`` in ``modal/sandbox/_common.py``). Commands whose wrapped argv is over
  :data:`ARGV_INLINE_LIMIT` bytes are spooled: the wrapper's arguments are written into the
  sandbox as a shell ``set --`` line through the filesystem API and the wrapper sources it.
* **stdin**: the SDK buffers at most 16 MiB of stdin between two ``drain()`` calls; stdin
  is sent in :data:`STDIN_CHUNK` pieces, each drained, then EOF.
* **timeouts**: ``exec(timeout=N)`` takes whole seconds; when it fires the SDK ends the
  output streams and ``wait()`` returns ``-1``. The runtime enforces the caller's exact
  timeout itself, passes the rounded-up value to Modal as a server-side backstop, and turns
  ``-1`` into :class:`~runtimes.errors.ExecTimeoutError`.
* **process trees**: Modal kills at most the process it started. Every command runs under the
  exec wrapper (``runtimes/scripts/exec.sh``, ``track`` mode), which starts it with
  ``setsid`` (its own session and process group) and records the group id in
  ``/tmp/.vf-sandbox``; a timeout, an output cap or a cancellation sends a second exec that
  kills the whole group.
* **files** go through ``Sandbox.filesystem`` (``stat``, ``read_bytes``, ``write_bytes``,
  ``make_directory``, ``remove``). Its typed exceptions are mapped to this suite's errors;
  an untyped ``SandboxFilesystemError`` is diagnosed with a small shell probe so the
  caller still gets the right errno. Reads check the size with ``stat`` first, so a file
  over ``max_bytes`` is refused without being transferred.

Creation: bounded lifetime (``timeout``, default one hour) and idle timeout by default,
network blocked by default, every sandbox tagged with the session labels (so
``vf-sandbox cleanup`` finds leaked ones with ``Sandbox.list(tags=...)``), a process-wide
cap on live sandboxes and on creations per second (:mod:`runtimes.limits`), and bounded
retries with backoff when Modal answers ``ResourceExhaustedError``.

The package: ``config.py`` (:class:`ModalConfig`), ``client.py`` (calling the SDK, its
exception table), ``process.py`` (exec), ``files.py`` (the filesystem API), ``runtime.py``
(:class:`ModalBackend`: creation, lifecycle, sweeping; :class:`ModalRuntime`, the runtime
composed around it) and ``scripts/`` (the shell programs run
in the sandbox).
"""

from __future__ import annotations

from .config import ModalConfig
from .process import ARGV_INLINE_LIMIT, STDIN_CHUNK
from .runtime import ModalBackend, ModalRuntime

__all__ = ["ARGV_INLINE_LIMIT", "STDIN_CHUNK", "ModalBackend", "ModalConfig", "ModalRuntime"]
