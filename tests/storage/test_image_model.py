"""An image behaves exactly like a flat bytearray under any sequence of writes, trims, write-zeroes, flushes,
seals, two-phase seals (freeze, writes, seal_frozen), compactions and crashes (hypothesis stateful testing
against a model)."""

from __future__ import annotations

import os
import random
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from aenv_node.storage.image import Image

BLOCK = 4096
NBLOCKS = 48
SIZE = NBLOCKS * BLOCK


def _offsets() -> st.SearchStrategy[int]:
    # bias towards block boundaries and their neighbours, where the read-modify-write edges are
    return st.one_of(
        st.integers(0, SIZE - 1),
        st.builds(lambda b, d: max(0, min(SIZE - 1, b * BLOCK + d)), st.integers(0, NBLOCKS - 1),
                  st.sampled_from([-1, 0, 1, 511, 512])),
    )


def _lengths() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 3 * BLOCK), st.sampled_from([BLOCK, 2 * BLOCK, 8 * BLOCK, 17 * BLOCK]))


class ImageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="aenv-img-")
        self.layers_dir = os.path.join(self.dir, "layers")
        os.makedirs(self.layers_dir)
        self.upper_dir = os.path.join(self.dir, "upper")
        self.model = bytearray(SIZE)
        self.since_flush: dict[int, set[bytes]] = {}  # block -> every value it held since the last flush
        self.img: Image | None = None
        self.frozen = None  # (frozen upper, model at the freeze) between freeze and seal_frozen

    @initialize(base=st.booleans(), seed=st.integers(0, 2**32 - 1))
    def start(self, base: bool, seed: int) -> None:
        paths = []
        if base:  # start from an imported base layer with some content
            from aenv_node.storage.importer import import_raw

            rnd = random.Random(seed)
            raw = os.path.join(self.dir, "base.raw")
            with open(raw, "wb") as f:
                f.truncate(SIZE)
                for _ in range(6):
                    b = rnd.randrange(NBLOCKS)
                    n = rnd.randrange(1, 4) * BLOCK
                    data = rnd.randbytes(min(n, SIZE - b * BLOCK))
                    f.seek(b * BLOCK)
                    f.write(data)
                    self.model[b * BLOCK : b * BLOCK + len(data)] = data
            paths.append(import_raw(raw, self.layers_dir).path)
        self.img = Image.open(paths, self.upper_dir, size=SIZE, fsync=False)

    def teardown(self) -> None:
        if self.img is not None:
            self.img.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- bookkeeping for crash checks ------------------------------------------------------------------------
    def _touch(self, offset: int, length: int) -> None:
        if not length:
            return
        for b in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
            self.since_flush.setdefault(b, {bytes(self.model[b * BLOCK : (b + 1) * BLOCK])})

    def _after(self, offset: int, length: int) -> None:
        if not length:
            return
        for b in range(offset // BLOCK, (offset + length - 1) // BLOCK + 1):
            self.since_flush[b].add(bytes(self.model[b * BLOCK : (b + 1) * BLOCK]))

    # -- rules ---------------------------------------------------------------------------------------------
    @rule(offset=_offsets(), length=_lengths(), seed=st.integers(0, 255))
    def write(self, offset: int, length: int, seed: int) -> None:
        length = min(length, SIZE - offset)
        data = random.Random(seed * 7919 + length).randbytes(length)
        self._touch(offset, length)
        self.img.pwrite(offset, data)
        self.model[offset : offset + length] = data
        self._after(offset, length)

    @rule(offset=_offsets(), length=_lengths(), trim=st.booleans())
    def zero(self, offset: int, length: int, trim: bool) -> None:
        length = min(length, SIZE - offset)
        self._touch(offset, length)
        (self.img.trim if trim else self.img.write_zeroes)(offset, length)
        self.model[offset : offset + length] = bytes(length)
        self._after(offset, length)

    @rule(offset=_offsets(), length=_lengths())
    def read(self, offset: int, length: int) -> None:
        length = min(length, SIZE - offset)
        assert self.img.pread(offset, length) == bytes(self.model[offset : offset + length])

    @rule()
    def flush(self) -> None:
        self.img.flush()
        self.since_flush.clear()

    @rule(copy_garbage=st.booleans())
    def seal(self, copy_garbage: bool) -> None:
        # copy_garbage: any trimmed block makes the seal copy live blocks instead of adopting the data file
        self.img.seal(self.layers_dir, max_garbage=0.0 if copy_garbage else 0.25,
                      min_garbage_bytes=0 if copy_garbage else 1 << 20)
        self.since_flush.clear()  # a seal makes everything durable

    @precondition(lambda self: self.frozen is None)
    @rule()
    def freeze(self) -> None:
        self.frozen = (self.img.freeze(), bytes(self.model))

    @precondition(lambda self: self.frozen is not None)
    @rule(copy_garbage=st.booleans())
    def seal_frozen(self, copy_garbage: bool) -> None:
        from aenv_node.storage.layer import LayerReader

        frozen, at_freeze = self.frozen
        files = [frozen.upper.data_path, frozen.upper.log_path]
        info = self.img.seal_frozen(frozen, self.layers_dir, max_garbage=0.0 if copy_garbage else 0.25,
                                    min_garbage_bytes=0 if copy_garbage else 1 << 20)
        self.frozen = None
        assert not any(os.path.exists(f) for f in files)  # the frozen upper's files are gone once sealed
        assert info.digest in [l.digest for l in self.img.layers]  # the layer took the frozen upper's place
        with LayerReader.open(info.path) as layer:  # it holds what was written before the freeze, no more
            for e in layer.iter_extents():
                assert layer.read(e.offset, e.length) == at_freeze[e.offset : e.offset + e.length]
        self.since_flush.clear()  # sealing the frozen upper made it durable; the new upper is flushed below
        self.img.flush()

    @precondition(lambda self: self.img is not None and self.frozen is None and len(self.img.layers) >= 2)
    @rule(data=st.data(), compression=st.sampled_from([None, "zstd"]))
    def compact(self, data: st.DataObject, compression: str | None) -> None:
        n = len(self.img.layers)
        start = data.draw(st.integers(0, n - 2))
        stop = data.draw(st.integers(start + 2, n))
        self.img.compact(start, stop, self.layers_dir, compression=compression)
        assert len(self.img.layers) == n - (stop - start) + 1

    @precondition(lambda self: self.frozen is None)  # a frozen upper is not reopenable until sealed (documented)
    @rule()
    def crash_after_flush(self) -> None:
        """kill -9 right after a flush: nothing may be lost."""
        self.img.flush()
        self._reopen()
        self.since_flush.clear()

    @precondition(lambda self: self.frozen is None)
    @rule()
    def crash(self) -> None:
        """kill -9 at an arbitrary point: flushed data survives; each block written since reads as one of the
        values it held since the last flush."""
        self._reopen()
        for b in range(NBLOCKS):
            got = self.img.pread(b * BLOCK, BLOCK)
            if b in self.since_flush:
                assert got in self.since_flush[b], f"block {b} reads a value it never held since the flush"
                self.model[b * BLOCK : (b + 1) * BLOCK] = got
            else:
                assert got == self.model[b * BLOCK : (b + 1) * BLOCK], f"flushed block {b} lost"
        self.since_flush.clear()

    def _reopen(self) -> None:
        digests = [l.digest for l in self.img.layers]
        self.img.abandon()
        self.img = Image.reopen(self.upper_dir, self.layers_dir, fsync=False)  # from the stack the upper recorded
        assert [l.digest for l in self.img.layers] == digests

    @invariant()
    def matches_model(self) -> None:
        if self.img is not None:
            assert self.img.pread(0, SIZE) == bytes(self.model)


ImageMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=35, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestImageModel = ImageMachine.TestCase
