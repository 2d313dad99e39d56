"""What a template build is asked to make (``Recipe``), and the log it writes as it goes (``BuildLog``).

A recipe is what E2B's ``POST /v2/templates/{id}/builds/{buildID}`` carries (the SDKs' ``Template`` builder
serializes to it): FROM an image (with registry credentials for that pull only) or another template, then
steps (RUN, COPY, ENV, WORKDIR, USER), then a start command and a ready command. The API layer validates the
JSON; this module holds the typed result, so the build never sees wire names.

The log is what ``GET .../builds/{buildID}/status?logsOffset=N`` pages through and what the SDK's
``on_build_logs`` prints: kept in memory while the node runs, and appended to ``build.log.jsonl`` in the
build's directory, so a build's log outlives a restart of the node.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["BuildLog", "LogEntry", "Recipe", "Step", "STEP_KINDS"]

STEP_KINDS = ("RUN", "COPY", "ENV", "WORKDIR", "USER")


@dataclass(frozen=True)
class Step:
    kind: str  # one of STEP_KINDS
    args: tuple[str, ...]
    files_hash: str | None = None  # COPY: the uploaded archive's hash
    force: bool = False

    def describe(self) -> str:
        if self.kind == "ENV":
            pairs = zip(self.args[::2], self.args[1::2], strict=False)
            return "ENV " + " ".join(f"{k}={v}" for k, v in pairs)
        return f"{self.kind} {' '.join(a for a in self.args if a)}"


@dataclass(frozen=True)
class Recipe:
    from_image: str | None = None
    from_template: str | None = None
    #: (username, password) for the image pull only: never stored, never logged
    credentials: tuple[str, str] | None = field(default=None, repr=False)
    steps: tuple[Step, ...] = ()
    start_cmd: str | None = None
    ready_cmd: str | None = None
    force: bool = False
    #: the ready command's time limit when longer than ``templates.ready_timeout_s`` (a built-in whose start is
    #: slow under emulation); the API never sets it
    ready_timeout_s: float | None = None

    @property
    def source(self) -> str:
        return f"image {self.from_image}" if self.from_image else f"template {self.from_template}"


@dataclass(frozen=True)
class LogEntry:
    timestamp: dt.datetime
    level: str  # debug | info | warn | error (E2B's LogLevel)
    message: str
    step: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"timestamp": self.timestamp.isoformat().replace("+00:00", "Z"), "level": self.level,
               "message": self.message}
        if self.step is not None:
            out["step"] = self.step
        return out


class BuildLog:
    """An append-only build log, in memory and in ``path`` (one JSON object per line). Thread-safe: lines come
    from the build's task and from the threads that convert layers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: list[LogEntry] = []
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)

    def add(self, message: str, *, level: str = "info", step: str | None = None) -> None:
        entry = LogEntry(dt.datetime.now(dt.timezone.utc), level, message.rstrip("\n"), step)
        with self._lock:
            self._entries.append(entry)
            with self.path.open("a") as f:
                f.write(json.dumps(entry.to_json()) + "\n")

    def info(self, message: str) -> None:
        self.add(message)

    @property
    def stage(self) -> str:
        """Where the build is, as E2B's failure reason names it (``reason.step``; the SDK points its traceback at
        that instruction): "base" before the first step (pull, conversion, boot), the step's number during one,
        "finalize" for the start and ready commands and the snapshot."""
        with self._lock:
            step = next((e.step for e in reversed(self._entries) if e.step is not None), None)
        if step is None:
            return "base"
        return step if step.isdigit() else "finalize"

    def entries(self, offset: int = 0, limit: int = 100) -> list[LogEntry]:
        with self._lock:
            return self._entries[max(0, offset):max(0, offset) + limit]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    @classmethod
    def load(cls, path: Path) -> "BuildLog":
        """A finished build's log, read back from its file (after a restart)."""
        log = cls.__new__(cls)
        log.path, log._lock, log._entries = path, threading.Lock(), []
        try:
            lines = path.read_text().splitlines()
        except OSError:
            lines = []
        for line in lines:
            try:
                d = json.loads(line)
                ts = dt.datetime.fromisoformat(str(d["timestamp"]).replace("Z", "+00:00"))
                log._entries.append(LogEntry(ts, str(d["level"]), str(d["message"]), d.get("step")))
            except (ValueError, KeyError, TypeError):
                continue
        return log
