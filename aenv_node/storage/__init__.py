"""Layered block storage: immutable content-addressed layers, a writable upper per sandbox, images that stack
them and serve them as a block device to frontends (NBD, FUSE, ublk), and the operations on stacks (seal,
compaction, import, diff, materialize into a flat file)."""

from .blockdev import BlockDevice, FlatFileDevice
from .compact import Change, compact_layers, diff_extents
from .errors import (
    ImageError,
    LayerCorrupt,
    LayerFormatError,
    OutOfRange,
    ReadOnlyDevice,
    StorageError,
    UpperCorrupt,
    UpperFull,
)
from .image import Image, LiveDisk
from .importer import import_raw, import_raw_cached
from .layer import Extent, LayerInfo, LayerReader, LayerWriter
from .layer_pool import LayerPool
from .layer_ref import LayerRef, LayerSourceProvider, open_image, open_reader
from .materialize import MaterializeStats, materialize, reflink_supported
from .source import BytesSource, FileSource, RandomAccessSource
from .upper import Upper

__all__ = [
    "BlockDevice",
    "FlatFileDevice",
    "RandomAccessSource",
    "FileSource",
    "BytesSource",
    "Image",
    "LiveDisk",
    "Upper",
    "LayerReader",
    "LayerWriter",
    "LayerPool",
    "LayerRef",
    "LayerSourceProvider",
    "open_image",
    "open_reader",
    "LayerInfo",
    "Extent",
    "Change",
    "compact_layers",
    "diff_extents",
    "import_raw",
    "import_raw_cached",
    "materialize",
    "MaterializeStats",
    "reflink_supported",
    "StorageError",
    "OutOfRange",
    "ReadOnlyDevice",
    "LayerCorrupt",
    "LayerFormatError",
    "UpperCorrupt",
    "UpperFull",
    "ImageError",
]
