"""Firecracker driver (REST API over a unix socket; optional jailer)."""

from .api import FirecrackerApi
from .driver import FirecrackerDriver, FirecrackerVm, JailerConfig

__all__ = ["FirecrackerApi", "FirecrackerDriver", "FirecrackerVm", "JailerConfig"]
