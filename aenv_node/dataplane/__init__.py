"""The data plane: one process per node that serves every running sandbox's disk and is the parent of its VMMs,
so that a restart of the control plane (the node's API and orchestration) leaves running sandboxes running.

``server`` is the process; ``client`` is how the control plane starts it, finds it again, and holds what it
serves; ``wire`` is the one-line JSON call between the two."""

from .client import DataPlaneClient, HeldDisk, RemoteDisk, RemoteProcess
from .server import DataPlane, serve_dataplane
from .wire import DataPlaneError, DataPlaneUnavailable, vmm_key

__all__ = [
    "DataPlane",
    "DataPlaneClient",
    "DataPlaneError",
    "DataPlaneUnavailable",
    "HeldDisk",
    "RemoteDisk",
    "RemoteProcess",
    "serve_dataplane",
    "vmm_key",
]
