"""Typed errors of the runtime and snapshot operations: one exception per condition.

The snapshot operations' own (``SnapshotNotFound``, ``SandboxConflict``, ``ForkLimit``, ``StateDiskFull``) are defined in
``snapshot/errors.py`` and re-exported here. They carry no HTTP status: the API maps them once, at its edge, by one table
(``api/errors.py``). The CLI and tests see the same classes.
"""

from __future__ import annotations

from ..snapshot.errors import ForkLimit, SandboxConflict, SnapshotNotFound, StateDiskFull

__all__ = [
    "RuntimeLayerError",
    "NodeDraining",
    "NodeNotReady",
    "TemplateNotFound",
    "TemplateNotReady",
    "SnapshotNotFound",
    "SandboxNotRunning",
    "SandboxConflict",
    "ForkLimit",
    "StateDiskFull",
    "PoolInUse",
    "TemplateRequestError",
    "TemplateProtected",
    "TemplateBusy",
    "TemplateBuildFailed",
]


class RuntimeLayerError(Exception):
    """Base of runtime errors."""


class NodeDraining(RuntimeLayerError):
    """The node is shutting down and accepts no new operations."""

    def __init__(self) -> None:
        super().__init__("the node is shutting down; retry on another node or after restart")


class NodeNotReady(RuntimeLayerError):
    """The sandbox service has not started yet (or has stopped): no sandbox can start now."""


class TemplateNotFound(RuntimeLayerError):
    """No template (or alias) of that name on this node."""


class TemplateNotReady(RuntimeLayerError):
    """The template exists but has no committed boot snapshot yet (building, or its build failed)."""


class SandboxNotRunning(RuntimeLayerError):
    """Traffic for a sandbox that is unknown, killed, or paused without autoResume."""


class PoolInUse(RuntimeLayerError):
    """The configured slot range is already routed on this host (another node?)."""


class TemplateRequestError(RuntimeLayerError):
    """A template build request the node cannot take (a bad name, a build started twice)."""


class TemplateProtected(TemplateRequestError):
    """The node's own templates (``base``, ``code-interpreter-v1``): no build, tag or delete of them by request."""


class TemplateBusy(TemplateRequestError):
    """A template with a build in progress cannot be deleted, and a build cannot be started twice."""


class TemplateBuildFailed(RuntimeLayerError):
    """A sandbox asked for a template whose builds all failed (nothing to retry until a build succeeds)."""
