"""Errors raised while building the guest kit and template root filesystems."""

from __future__ import annotations


class ImageError(Exception):
    """Base class for every error of the images package."""


class KernelImageError(ImageError):
    """A kernel image could not be read or unpacked (not a bzImage, unknown compression, not an ELF)."""


class PackageError(ImageError):
    """A Debian package could not be resolved or downloaded.

    Usually the apt lists are missing or stale: run ``apt-get update`` and check that the Debian mirror in
    /etc/apt/sources.list is reachable.
    """


class KitBuildError(ImageError):
    """Building the guest kit failed (a tool failed, a library was missing, a check did not pass)."""


class RootfsBuildError(ImageError):
    """Building a template root filesystem failed (debootstrap, chroot set-up or mkfs.ext4)."""


class ToolMissingError(ImageError):
    """A host program the build needs is not installed (the message names the Debian package)."""
