"""A running sandbox's console, read into its logs (``state/sandbox_logs.py``) while the sandbox runs.

Why hand-written: the VMM writes the guest's serial console to a file (QEMU ``-serial file:``, Firecracker's
stdout) and nothing else knows its format. Everything the guest prints there (kernel messages, the kit's init,
envd's log records, whatever a root process writes to ``/dev/console``) becomes one log line, classified by
:func:`classify` into E2B's levels. A :class:`ConsoleLog` runs in the sandbox's own nursery: every
``logs.poll_interval_s`` it reads what was appended since the last read (at most ``READ_CHUNK`` bytes a round,
so a flood is read at a bounded pace) and writes the complete lines in one transaction; when the sandbox stops
it reads to the end of the file first, so the last lines before a pause or a kill are kept. Each run of a
sandbox (create, resume, fork) has a new console file, read from its start; a run taken over after a restart of
the node (the VMM still writing the same file) goes on from where the previous reader's last stored line ended:
the offset is stored in the transaction that stores those lines (``state/sandbox_logs.py``
``store_console``), so a node killed at any point neither loses a line nor stores one twice.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
from pathlib import Path
from typing import Optional

import trio

from ..config import LogsSection
from ..state import Database, utcnow
from ..state.sandbox_logs import LogLine, console_offset, store_console

__all__ = ["ConsoleLog", "classify"]

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20

# envd's records: "2026-12-02 16:50:01,123 INFO envd.process: started process 12: ..." (guest/__main__.py)
_ENVD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.\-]+): (.*)$")
_ENVD_LEVELS = {"DEBUG": "debug", "INFO": "info", "WARNING": "warn", "ERROR": "error", "CRITICAL": "error"}
# the kernel's, with printk times: the guest boots `quiet`, so what reaches the console is a warning or worse
_KERNEL = re.compile(r"^\[\s*\d+\.\d+\] ?(.*)$")
# the kit's init (images/data/aenv-init.sh, initramfs-init.sh)
_INIT = re.compile(r"^(aenv(?:-init)?|initramfs): ")
_INIT_TROUBLE = re.compile(r"fail|error|exited|cannot|not found", re.IGNORECASE)
# a record's continuation (a traceback under an envd error)
_CONTINUATION = re.compile(r"^(\s|Traceback \(most recent call last\)|[\w.]+(Error|Exception)\b)")
# terminal control sequences and other control characters a console line may carry
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]|[\x00-\x08\x0b-\x1f\x7f]")


def classify(text: str, ts: dt.datetime, previous: Optional[LogLine] = None) -> LogLine:
    """One console line as a log line: its source, level and message (``previous``: the line before it, whose
    level and source a traceback's continuation lines take)."""
    m = _ENVD.match(text)
    if m:
        return LogLine(ts, _ENVD_LEVELS[m.group(1)], "envd", m.group(3), logger=m.group(2))
    if previous is not None and previous.source == "envd" and previous.level == "error" and _CONTINUATION.match(text):
        return LogLine(ts, "error", "envd", text, logger=previous.logger)
    m = _KERNEL.match(text)
    if m:
        return LogLine(ts, "warn", "kernel", m.group(1))
    if _INIT.match(text):
        return LogLine(ts, "error" if _INIT_TROUBLE.search(text) else "info", "init", text)
    return LogLine(ts, "info", "console", text)


class ConsoleLog:
    """Follows one console file of one sandbox run and writes its lines to the sandbox's logs."""

    def __init__(self, db: Database, sandbox_id: str, path: Path, limits: LogsSection, *, vmm_pid: int,
                 taken_over: bool = False) -> None:
        self.db = db
        self.sandbox_id = sandbox_id
        self.path = path
        self.limits = limits
        # the run: its console file and the VMM writing it (a resume writes a new file at the same path)
        self.run_name = f"{path}@{vmm_pid}"
        self.taken_over = taken_over
        self.offset: Optional[int] = None  # where the next read starts; a taken-over run's is read first
        self.partial = b""
        self.previous: Optional[LogLine] = None
        self.lines_written = 0

    async def run(self) -> None:
        """Read every poll interval until cancelled; then read what is left (shielded), so nothing printed
        before the stop is lost."""
        try:
            while True:
                await trio.sleep(self.limits.poll_interval_s)
                await self.read_new()
        finally:
            with trio.CancelScope(shield=True):
                try:
                    while await self.read_new(final=True):
                        pass
                except Exception:
                    log.exception("sandbox %s: reading the last console lines failed", self.sandbox_id)

    async def read_new(self, *, final: bool = False) -> int:
        """Read what the console got since the last read and store its complete lines (``final``: the last
        partial line too); returns the bytes read."""
        if self.offset is None:
            self.offset = (await self.db.run(console_offset, self.sandbox_id, self.run_name)
                           if self.taken_over else 0)
        if not final and self._size() == self.offset:
            return 0  # nothing new: no worker thread for an idle console (two polls a second per running sandbox)
        chunk = await trio.to_thread.run_sync(self._read_chunk, self.offset)
        self.offset += len(chunk)
        data = self.partial + chunk
        lines = data.split(b"\n")
        self.partial = lines.pop()
        cut = self.limits.max_line_chars
        if len(self.partial) > 4 * cut or (final and not chunk and self.partial):
            lines.append(self.partial)  # a line without an end: stored as it is, not held without bound
            self.partial = b""
        out: list[LogLine] = []
        ts = utcnow()
        for raw in lines:
            text = _CONTROL.sub("", raw.decode("utf-8", errors="replace")).rstrip()
            if not text:
                continue
            if len(text) > cut:
                text = text[:cut - 1] + "…"
            line = classify(text, ts, self.previous)
            self.previous = line
            out.append(line)
        if chunk or out:  # the lines and the offset they end at, in one transaction
            await self.db.run(store_console, self.sandbox_id, out, keep=self.limits.max_lines_per_sandbox,
                              run=self.run_name, bytes_read=self.offset - len(self.partial))
            self.lines_written += len(out)
        return len(chunk)

    def _size(self) -> Optional[int]:
        """The console file's size. A ``stat`` in the event loop: of a local file the VMM keeps open (its inode
        is in memory), it does not wait on the disk the way a read may."""
        try:
            return os.stat(self.path).st_size
        except OSError:
            return None

    def _read_chunk(self, offset: int) -> bytes:
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                chunk = f.read(READ_CHUNK)
        except FileNotFoundError:
            return b""
        return chunk
