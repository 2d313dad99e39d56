"""Guest memory ranges: the unit dirty-page tracking, captures and memory images speak in."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PAGE_SIZE", "MemoryRange"]

PAGE_SIZE = 4096


@dataclass(frozen=True)
class MemoryRange:
    """A byte range of guest memory (page aligned), as an offset into the memory image."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length
