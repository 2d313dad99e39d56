"""Errors of template builds: each says, in one line, what the user has to change."""

from __future__ import annotations

__all__ = ["GuestExecError", "GuestNotReady", "ImageHasNoShell", "KernelRefused", "TemplateBuildError"]


class TemplateBuildError(Exception):
    """A template could not be built (the message is the build's failure reason, shown in its status)."""


class ImageHasNoShell(TemplateBuildError):
    """The image has no ``/bin/sh``: envd runs commands and build steps through a shell."""


class GuestExecError(TemplateBuildError):
    """envd in the build VM refused or broke off a request (a command failing is not this: its exit status
    is the step's result)."""


class GuestNotReady(TemplateBuildError):
    """A guest without envd never printed the line that says it is up (``import_vm``)."""


class KernelRefused(TemplateBuildError):
    """What was given as a VM's kernel is not one the node can boot (``import_vm``: not an x86-64 ELF, too large)."""
