"""Errors of template builds: each says, in one line, what the user has to change."""

from __future__ import annotations

__all__ = ["TemplateBuildError", "ImageHasNoShell"]


class TemplateBuildError(Exception):
    """A template could not be built (the message is the build's failure reason, shown in its status)."""


class ImageHasNoShell(TemplateBuildError):
    """The image has no ``/bin/sh``: envd runs commands and build steps through a shell."""
