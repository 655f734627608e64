"""vf-sandbox runtimes: one async API and one error taxonomy over every kind of sandbox.

Importing this package loads only the core (anyio, pydantic, tenacity); each backend's
SDK is imported when that backend is used.
"""

from __future__ import annotations

from .backend import Backend, CreateRequest, SweepScope
from .base import Runtime, live_runtimes
from .capabilities import (
    AgentFilesCheck,
    BlockingTeardown,
    FileFastPath,
    HostRouter,
    MemoryKillProbe,
    ProcessSweeper,
    RemoveFastPath,
    ResetProof,
    SandboxLister,
    ShellOpener,
    Snapshotter,
    StreamSpawner,
    TreeFastPath,
    TrustedReader,
)
from .channel.agent.wire import PathInfo
from .cleanup import cleanup_sandboxes, remove_snapshot
from .composed import runtime_class
from .config import RuntimeConfig, RuntimeConfigError
from .errors import (
    BuildContextError,
    ChannelTamperedError,
    CommandFailedError,
    ExecTimeoutError,
    ListingLimitExceededError,
    OutputLimitExceededError,
    ProvisioningError,
    SandboxError,
    SandboxFileExistsError,
    SandboxFileNotFoundError,
    SandboxInvalidArgumentError,
    SandboxIsADirectoryError,
    SandboxNoSpaceError,
    SandboxNotADirectoryError,
    SandboxPermissionError,
    SandboxProcessLimitError,
    SandboxResourceError,
    SandboxTransportError,
    SandboxUnavailableError,
    SandboxUserNotFoundError,
    SandboxUserRefusedError,
    ShellSessionError,
    UnsafeArchiveMemberError,
    names_the_program,
)
from .lifecycle import State
from .listing import FileInfo
from .models import ExecRequest, ExecResult, OutputSink, SandboxInfo
from .pool import PoolClosedError, PoolTimeoutError, RuntimePool
from .reaper import drain_removals, drain_removals_blocking
from .registry import (
    RuntimePluginError,
    UnknownRuntimeError,
    available_runtimes,
    load_runtime_class,
    open_runtime,
    resolve_runtime_config,
    runtime_is_local,
)
from .snapshot import SandboxSnapshot, SnapshotNotFoundError, SnapshotUnsupportedError
from .subprocess import SubprocessConfig, SubprocessRuntime
from .sync import BlockingCallInEventLoopError, SyncRuntime, SyncShellSession, open_runtime_sync

__all__ = [
    "AgentFilesCheck",
    "Backend",
    "BlockingCallInEventLoopError",
    "BlockingTeardown",
    "BuildContextError",
    "ChannelTamperedError",
    "CommandFailedError",
    "CreateRequest",
    "ExecRequest",
    "ExecResult",
    "ExecTimeoutError",
    "FileFastPath",
    "FileInfo",
    "HostRouter",
    "ListingLimitExceededError",
    "MemoryKillProbe",
    "OutputLimitExceededError",
    "OutputSink",
    "PathInfo",
    "PoolClosedError",
    "PoolTimeoutError",
    "ProcessSweeper",
    "ProvisioningError",
    "RemoveFastPath",
    "ResetProof",
    "Runtime",
    "RuntimeConfig",
    "RuntimeConfigError",
    "RuntimePluginError",
    "RuntimePool",
    "SandboxError",
    "SandboxFileExistsError",
    "SandboxFileNotFoundError",
    "SandboxInfo",
    "SandboxInvalidArgumentError",
    "SandboxIsADirectoryError",
    "SandboxLister",
    "SandboxNoSpaceError",
    "SandboxNotADirectoryError",
    "SandboxPermissionError",
    "SandboxProcessLimitError",
    "SandboxResourceError",
    "SandboxSnapshot",
    "SandboxTransportError",
    "SandboxUnavailableError",
    "SandboxUserNotFoundError",
    "SandboxUserRefusedError",
    "ShellOpener",
    "ShellSessionError",
    "SnapshotNotFoundError",
    "SnapshotUnsupportedError",
    "Snapshotter",
    "State",
    "StreamSpawner",
    "SubprocessConfig",
    "SubprocessRuntime",
    "SweepScope",
    "SyncRuntime",
    "SyncShellSession",
    "TreeFastPath",
    "TrustedReader",
    "UnknownRuntimeError",
    "UnsafeArchiveMemberError",
    "available_runtimes",
    "cleanup_sandboxes",
    "drain_removals",
    "drain_removals_blocking",
    "live_runtimes",
    "load_runtime_class",
    "names_the_program",
    "open_runtime",
    "open_runtime_sync",
    "remove_snapshot",
    "resolve_runtime_config",
    "runtime_class",
    "runtime_is_local",
]
