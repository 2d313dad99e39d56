"""An image: an ordered stack of immutable layers (bottom first) plus one writable upper, served as a block
device (``BlockDevice``) to the frontends.

Opening merges the layer indexes once (``stack.merge``) into a partition of the device into runs, kept as plain
lists: a read of the lower stack is one ``bisect`` and one verified ``pread`` per contiguous run.  The upper's
chunked block map is consulted first, and skipped in O(1) for 4 MiB regions never written.

Concurrency: reads take no lock.  They use the *generation* current when they start (layers + merged index +
upper, an immutable tuple); seal and compaction build the next generation and swap it in with one assignment.
Resources dropped by a swap are closed by reference counting when the last in-flight read lets go of them, so a
descriptor is never closed under a read (and never reused for another file while a read could still use it).
Writes are serialised by a write lock (partial-block writes read-modify-write, so two writes into one block must
not interleave); ``flush`` holds it only to detach the pending log records, then syncs outside it.
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol, Sequence

from . import layer_format as F
from .blockdev import check_range
from .errors import ImageError, OutOfRange, ReadOnlyDevice
from .layer import LAYER_SUFFIX, LayerInfo, LayerReader
from .stack import Runs, StackLayer, layer_level, merge, merge_layers, runs_level
from .upper import CHUNK_SHIFT, ZEROED, Upper

if TYPE_CHECKING:
    from .layer_pool import LayerPool

__all__ = ["Image", "LiveDisk"]

_BLOCK = F.BLOCK
_MASK = F.BLOCK - 1
_SHIFT = F.BLOCK_SHIFT
_CSHIFT = CHUNK_SHIFT
_CMASK = (1 << CHUNK_SHIFT) - 1
_AUTO_FLUSH_BYTES = 1 << 20  # pending log records (32 B per new run) past which a write flushes by itself


def _digests(layers: Sequence[StackLayer]) -> list[str] | None:
    """The layers' digests, or None if any is unknown (then no stack is recorded in the upper)."""
    out = [l.digest for l in layers]
    return None if any(d is None for d in out) else [d for d in out if d is not None]


class _Gen:
    """One immutable view of the image's stack."""

    __slots__ = ("layers", "upper", "runs", "starts", "owner", "doff", "readers")

    def __init__(self, layers: tuple[StackLayer, ...], upper: Upper | None, runs: Runs, size: int) -> None:
        self.layers = layers
        self.upper = upper
        self.runs = runs
        self.starts, self.owner, self.doff = runs.partition(size)
        self.readers = [l.read_stream for l in layers]


class _FrozenUpper:
    """A frozen upper serving reads as a level of the stack until it is sealed (see ``Image.freeze``).

    Looks like a ``LayerReader`` to the image (``extents``, ``read_stream``, ``digest``, ``close``): its extents
    are the upper's block map with data offsets = physical block offsets, exactly what the sealed layer's index
    will hold, and its reads go straight to the upper's data file (no checksums exist before the seal)."""

    def __init__(self, upper: Upper) -> None:
        from .seal import upper_extents

        self.upper = upper
        self.extents = upper_extents(upper)
        self.virtual_size = upper.virtual_size
        self.digest: str | None = None
        self.name = f"frozen upper {upper.data_path}"

    def read_stream(self, doff: int, length: int) -> bytes:
        return self.upper.read_pblocks(0, doff, length)

    def close(self) -> None:
        self.upper.abandon()


class Image:
    """A layered block device.  ``layers`` bottom first; ``upper`` None makes it read-only.

    ``size`` defaults to the upper's size, else the top layer's.  Layers may be smaller than the device (what
    lies past their end is a hole).  The image owns its upper (flushed and closed by ``close()``) and the layers
    it opened itself (``Image.open``) or created (seal, compaction); readers passed in stay the caller's unless
    ``own_layers`` (share them between images with a ``LayerPool``).
    """

    def __init__(self, layers: Sequence[LayerReader], upper: Upper | None = None, *, size: int | None = None,
                 own_layers: bool = False) -> None:
        layers = tuple(layers)
        if size is None:
            if upper is not None:
                size = upper.virtual_size
            elif layers:
                size = layers[-1].virtual_size
            else:
                raise ImageError("an image needs at least one layer or an upper")
        if upper is not None and upper.virtual_size != size:
            raise ImageError(f"upper is {upper.virtual_size} bytes, image is {size}")
        for l in layers:
            if l.virtual_size > size:
                raise ImageError(f"layer {l.name} ({l.virtual_size} bytes) is larger than the image ({size})")
        digests = _digests(layers)
        if upper is not None and digests is not None:
            if upper.stack is None:
                upper.set_stack(digests)
            elif upper.stack != digests:
                raise ImageError(
                    f"upper {upper.path} was written over layers {upper.stack}, not {digests}: open it with the "
                    f"recorded stack (Image.reopen) or remove it to discard its writes")
        self.size = size
        self._owned: set[int] = {id(l) for l in layers} if own_layers else set()
        self._wlock = threading.Lock()
        self._flock = threading.Lock()
        self._closed = False
        self._gen = _Gen(layers, upper, merge_layers(layers), size)

    @classmethod
    def open(cls, layer_paths: Iterable[str | os.PathLike[str]], upper_dir: str | os.PathLike[str] | None = None,
             *, size: int | None = None, fsync: bool = True, verify_reads: bool = True) -> "Image":
        """Open layer files (bottom first) and the upper in ``upper_dir`` (created, or reopened and replayed)."""
        layers: list[LayerReader] = []
        try:
            for p in layer_paths:
                layers.append(LayerReader.open(p, verify_reads=verify_reads))
            upper = None
            if upper_dir is not None:
                if size is None:
                    if not layers:
                        raise ImageError("size is required for an image with no layers")
                    size = layers[-1].virtual_size
                upper = Upper(upper_dir, size, fsync=fsync)
            try:
                return cls(layers, upper, size=size, own_layers=True)
            except BaseException:
                if upper is not None:
                    upper.abandon()
                raise
        except BaseException:
            for l in layers:
                l.close()
            raise

    @classmethod
    def reopen(cls, upper_dir: str | os.PathLike[str], layers: "str | os.PathLike[str] | LayerPool", *,
               fsync: bool = True, verify_reads: bool = True) -> "Image":
        """Reopen an image from its upper alone: the upper records the digests of the layers it sits on (updated
        by every seal and compaction in the same commit), found in the directory or ``LayerPool`` ``layers``.
        This is how a node restarted after a crash gets every sandbox disk back exactly as last flushed."""
        from .layer_pool import LayerPool

        peek = Upper.peek(upper_dir)
        if peek is None:
            raise ImageError(f"no writable upper in {os.fspath(upper_dir)}")
        size, stack = peek
        if stack is None:
            raise ImageError(f"upper {os.fspath(upper_dir)} records no layer stack; open it with Image.open")
        if isinstance(layers, LayerPool):
            readers = [layers.get(d) for d in stack]
            return cls(readers, Upper(upper_dir, size, fsync=fsync), size=size)
        return cls.open([os.path.join(os.fspath(layers), d + LAYER_SUFFIX) for d in stack], upper_dir, size=size,
                        fsync=fsync, verify_reads=verify_reads)

    # -- introspection -------------------------------------------------------------------------------------
    @property
    def layers(self) -> tuple[StackLayer, ...]:
        """The read-only levels, bottom first: layers, and an upper that ``freeze`` took out of service until
        ``seal_frozen`` replaces it by its layer."""
        return self._gen.layers

    @property
    def upper(self) -> Upper | None:
        return self._gen.upper

    @property
    def read_only(self) -> bool:
        return self._gen.upper is None

    # -- reads ---------------------------------------------------------------------------------------------
    def pread(self, offset: int, length: int) -> bytes:
        end = offset + length
        if offset < 0 or length <= 0 or end > self.size:
            if length == 0 and 0 <= offset <= self.size:
                return b""
            raise OutOfRange(f"range [{offset}, {end}) outside device of {self.size} bytes")
        if self._closed:
            raise ImageError("image is closed")
        g = self._gen
        up = g.upper
        if up is not None and up._chunks:
            b0 = offset >> _SHIFT
            b1 = (end - 1) >> _SHIFT
            if b0 == b1:  # within one block: one scalar lookup in the upper's map
                arr = up._chunks.get(b0 >> _CSHIFT)
                if arr is not None:
                    st = arr.item(b0 & _CMASK)
                    if st >= 0:
                        return up.read_pblocks(st, offset & _MASK, length)
                    if st == ZEROED:
                        return bytes(length)
            elif up.touches(b0, b1 + 1):
                return self._read_mixed(g, up, offset, end)
        # lower stack; the one-run case inline (most reads)
        starts = g.starts
        i = bisect_right(starts, offset) - 1
        if end <= starts[i + 1]:
            o = g.owner[i]
            if o < 0:
                return bytes(length)
            return g.readers[o](g.doff[i] + offset - starts[i], length)
        return self._read_lower(g, offset, end)

    @staticmethod
    def _read_lower(g: _Gen, off: int, end: int) -> bytes:
        starts = g.starts
        i = bisect_right(starts, off) - 1
        if end <= starts[i + 1]:  # one run: the common case
            o = g.owner[i]
            if o < 0:
                return bytes(end - off)
            return g.readers[o](g.doff[i] + off - starts[i], end - off)
        parts = []
        owner, doff, readers = g.owner, g.doff, g.readers
        while off < end:
            rs, re_ = starts[i], starts[i + 1]
            t = re_ if re_ < end else end
            o = owner[i]
            parts.append(bytes(t - off) if o < 0 else readers[o](doff[i] + off - rs, t - off))
            off = t
            i += 1
        return b"".join(parts)

    def _read_mixed(self, g: _Gen, up: Upper, off: int, end: int) -> bytes:
        runs = up.runs(off >> _SHIFT, ((end - 1) >> _SHIFT) + 1)
        parts = []
        for vb, n, st in runs:
            s = vb << _SHIFT
            t = (vb + n) << _SHIFT
            if s < off:
                s = off
            if t > end:
                t = end
            if st >= 0:
                parts.append(up.read_pblocks(st, s - (vb << _SHIFT), t - s))
            elif st == ZEROED:
                parts.append(bytes(t - s))
            else:
                parts.append(self._read_lower(g, s, t))
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- writes --------------------------------------------------------------------------------------------
    def _writable(self) -> Upper:
        up = self._gen.upper
        if up is None:
            raise ReadOnlyDevice("image has no writable upper")
        if self._closed:
            raise ImageError("image is closed")
        return up

    def pwrite(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        check_range(self.size, offset, n)
        if n == 0:
            return
        with self._wlock:
            up = self._writable()
            self._pwrite_locked(up, offset, data)
            need_flush = up.pending_bytes >= _AUTO_FLUSH_BYTES
        if need_flush:
            self.flush()

    def _pwrite_locked(self, up: Upper, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        end = offset + n
        head = offset & _MASK
        tail = -end & _MASK
        if not head and not tail:
            up.write_blocks(offset >> _SHIFT, data)
            return
        a, b = offset - head, end + tail
        g = self._gen
        buf = bytearray(b - a)
        if b - a == _BLOCK:
            buf[:] = self._pread_gen(g, a, _BLOCK)
        else:
            if head:
                buf[:_BLOCK] = self._pread_gen(g, a, _BLOCK)
            if tail:
                buf[-_BLOCK:] = self._pread_gen(g, b - _BLOCK, _BLOCK)
        buf[head : head + n] = data
        up.write_blocks(a >> _SHIFT, buf)

    def _pread_gen(self, g: _Gen, off: int, length: int) -> bytes:
        up = g.upper
        if up is None or not up.touches(off >> _SHIFT, ((off + length - 1) >> _SHIFT) + 1):
            return self._read_lower(g, off, off + length)
        return self._read_mixed(g, up, off, off + length)

    def write_zeroes(self, offset: int, length: int) -> None:
        check_range(self.size, offset, length)
        if length == 0:
            return
        end = offset + length
        a = (offset + _MASK) & ~_MASK
        b = end & ~_MASK
        with self._wlock:
            up = self._writable()
            if a >= b:
                self._pwrite_locked(up, offset, bytes(length))
            else:
                if offset < a:
                    self._pwrite_locked(up, offset, bytes(a - offset))
                if b < end:
                    self._pwrite_locked(up, b, bytes(end - b))
                up.zero_blocks(a >> _SHIFT, (b - a) >> _SHIFT)
            need_flush = up.pending_bytes >= _AUTO_FLUSH_BYTES
        if need_flush:
            self.flush()

    def trim(self, offset: int, length: int) -> None:
        """Discard: the range reads back as zeros (same as ``write_zeroes``; neither stores data)."""
        self.write_zeroes(offset, length)

    def flush(self) -> None:
        with self._flock:
            with self._wlock:
                up = self._gen.upper
                if up is None or self._closed:
                    return
                pending = up.take_pending()
            up.commit(pending)

    # -- stack operations ----------------------------------------------------------------------------------
    def seal(self, layers_dir: str | os.PathLike[str], *, max_garbage: float = 0.25,
             min_garbage_bytes: int = 1 << 20) -> LayerInfo:
        """Turn the upper into the newest layer (file ``<digest>.layer`` in ``layers_dir``, on the same
        filesystem as the upper to avoid a copy) and continue on a fresh, empty upper.  Returns the new layer's
        info.  The new layer list (``layers``) is recorded in the upper in the same commit as the fresh upper
        (``Image.reopen`` finds it after a crash); callers may also keep it in their own records.
        ``max_garbage``: fraction of trimmed-away blocks in the upper's data file above which the live blocks
        are copied into a compact layer instead of adopting the file as is (if also >= ``min_garbage_bytes``)."""
        from .seal import seal_upper

        with self._flock, self._wlock:
            g = self._gen
            up = self._writable()
            info = seal_upper(up, layers_dir, max_garbage=max_garbage, min_garbage_bytes=min_garbage_bytes)
            layer = LayerReader.open(info.path)
            digests = _digests(g.layers)
            try:
                new_upper = up.reset(None if digests is None else digests + [info.digest])
            except BaseException:
                layer.close()
                raise
            self._owned.add(id(layer))
            k = len(g.layers)
            runs = merge([runs_level(g.runs), layer_level(layer.extents, owner=k)])
            self._gen = _Gen(g.layers + (layer,), new_upper, runs, self.size)
            return info

    def freeze(self) -> _FrozenUpper:
        """The instant half of a seal, for a live capture: writes continue on a fresh upper at once, and the
        current upper, frozen, stays in the stack (serving reads) until ``seal_frozen`` turns it into a layer.

        ``seal`` hashes and checksums the upper's data and fsyncs it (hundreds of ms for a busy disk); a VM
        must be paused while its disk and memory are captured at one instant, so a live snapshot freezes
        while paused and seals after resuming.  The cost here is creating the next generation's files.
        Until sealed the upper records no layer stack (``Image.reopen`` refuses it): only images that are
        not reopened after a crash (running sandboxes) should be frozen."""
        with self._flock, self._wlock:
            g = self._gen
            up = self._writable()
            frozen = _FrozenUpper(up)
            new_upper = up.reset(None, keep_files=True, sync=False)  # made durable by seal_frozen
            k = len(g.layers)
            runs = merge([runs_level(g.runs), layer_level(frozen.extents, owner=k)])
            self._owned.add(id(frozen))
            self._gen = _Gen(g.layers + (frozen,), new_upper, runs, self.size)
            return frozen

    def seal_frozen(self, frozen: _FrozenUpper, layers_dir: str | os.PathLike[str], *,
                    max_garbage: float = 0.25, min_garbage_bytes: int = 1 << 20) -> LayerInfo:
        """Seal an upper ``freeze`` took out of service into the layer ``<digest>.layer`` and put that layer in
        its place in the stack (the current upper then records the stack).  Runs without the write lock
        except for the swap: nobody writes a frozen upper."""
        from .seal import seal_upper

        info = seal_upper(frozen.upper, layers_dir, max_garbage=max_garbage, min_garbage_bytes=min_garbage_bytes)
        layer = LayerReader.open(info.path)
        try:
            with self._wlock:
                cur = self._gen
                idx = next((i for i, l in enumerate(cur.layers) if l is frozen), None)
                if idx is None:
                    raise ImageError("that frozen upper is not in this image's stack")
                layers = cur.layers[:idx] + (layer,) + cur.layers[idx + 1:]
                runs = merge_layers(layers)
                digests = _digests(layers)
                if cur.upper is not None:
                    if digests is not None:
                        cur.upper.set_stack(digests)  # also syncs the directory the freeze did not
                    else:
                        cur.upper._sync_dir()
                self._gen = _Gen(layers, cur.upper, runs, self.size)
                self._owned.add(id(layer))
                self._owned.discard(id(frozen))  # closed by refcount once in-flight reads finish
        except BaseException:
            layer.close()
            raise
        frozen.upper.remove_files()
        return info

    def compact(self, start: int, stop: int, layers_dir: str | os.PathLike[str], *,
                compression: str | None = None) -> LayerInfo:
        """Replace layers[start:stop] by one equivalent layer.  Safe to call from a background thread while
        the image serves I/O: the new layer is built without locks, then swapped in atomically; raises
        ``ImageError`` if those layers were meanwhile replaced by another compaction."""
        from .compact import compact_layers

        g = self._gen
        chain = g.layers[start:stop]
        if len(chain) < 1 or start < 0 or stop > len(g.layers):
            raise ImageError(f"bad layer range [{start}, {stop}) of {len(g.layers)} layers")
        info = compact_layers(chain, layers_dir, bottom=start == 0, compression=compression)
        layer = LayerReader.open(info.path)
        try:
            with self._wlock:
                cur = self._gen
                if len(cur.layers) < stop or any(a is not b for a, b in zip(cur.layers[start:stop], chain)):
                    raise ImageError("the layer stack changed while compacting; nothing swapped")
                layers = cur.layers[:start] + (layer,) + cur.layers[stop:]
                runs = merge_layers(layers)
                digests = _digests(layers)
                if cur.upper is not None and digests is not None:
                    cur.upper.set_stack(digests)  # the commit point: a crash before it keeps the old stack
                self._gen = _Gen(layers, cur.upper, runs, self.size)
                self._owned.add(id(layer))
                for old in chain:  # dropped: closed by refcount once in-flight reads finish
                    self._owned.discard(id(old))
        except BaseException:
            if not any(l is layer for l in self._gen.layers):
                layer.close()
            raise
        return info

    def changed_extents(self) -> Iterator[tuple[int, int, bool]]:
        """(offset, length, zeroed) of every range written or zeroed in the upper since the last seal."""
        up = self._gen.upper
        if up is not None:
            for vb, n, st in up.all_runs():
                yield vb << _SHIFT, n << _SHIFT, st == ZEROED

    # -- lifecycle -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Flush the upper and close it and the layers the image owns (stop serving I/O first)."""
        if self._closed:
            return
        self.flush()
        with self._flock, self._wlock:
            self._closed = True
            g = self._gen
            if g.upper is not None:
                g.upper.close()
            for l in g.layers:
                if id(l) in self._owned:
                    l.close()

    def abandon(self) -> None:
        """Drop everything without flushing (tests: what kill -9 leaves behind)."""
        self._closed = True
        g = self._gen
        if g.upper is not None:
            g.upper.abandon()
        for l in g.layers:
            if id(l) in self._owned:
                l.close()

    def __enter__(self) -> "Image":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self._gen
        return f"Image(size={self.size}, layers={len(g.layers)}, upper={g.upper!r})"


class _Named(Protocol):
    @property
    def digest(self) -> str | None: ...


class LiveDisk(Protocol):
    """What a running sandbox's operations use of its disk: an ``Image`` in this process, or the data plane's
    ``RemoteDisk`` (``dataplane/client.py``). The layers' digests (hex; None for an upper not sealed yet), the
    two halves of a live capture's seal, and closing it."""

    @property
    def layers(self) -> Sequence[_Named]: ...

    def freeze(self) -> Any: ...

    def seal_frozen(self, frozen: Any, layers_dir: str | os.PathLike[str]) -> LayerInfo: ...

    def close(self) -> None: ...
