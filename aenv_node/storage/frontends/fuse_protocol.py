"""The FUSE kernel protocol (``/dev/fuse``, include/uapi/linux/fuse.h, protocol 7.38): the constants and structs
the FUSE frontend speaks. Host byte order (little-endian on every platform we run on)."""

from __future__ import annotations

import struct

KERNEL_VERSION = 7
KERNEL_MINOR_VERSION = 38  # we reply with min(this, the kernel's)

# opcodes
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
GETXATTR = 22
LISTXATTR = 23
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
ACCESS = 34
CREATE = 35
INTERRUPT = 36
DESTROY = 38
BATCH_FORGET = 42
FALLOCATE = 43

# INIT flags
ASYNC_READ = 1 << 0
BIG_WRITES = 1 << 5
ASYNC_DIO = 1 << 15
PARALLEL_DIROPS = 1 << 18
MAX_PAGES = 1 << 22

# open reply flags
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6

# setattr valid bits
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3

# fallocate modes
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
FALLOC_FL_ZERO_RANGE = 0x10

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
OUT_HEADER = struct.Struct("<IiQ")  # len, error (negative errno), unique
INIT_IN = struct.Struct("<IIII")  # major, minor, max_readahead, flags (the rest is ignored)
INIT_OUT = struct.Struct("<IIIIHHIIHHI7I")  # 64 bytes
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")  # fuse_attr, 88 bytes
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, *_nsec (then attr)
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy (then attr)
OPEN_IN = struct.Struct("<II")
OPEN_OUT = struct.Struct("<QIi")
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, padding
WRITE_IN = struct.Struct("<QQIIQII")  # same layout; data follows
WRITE_OUT = struct.Struct("<II")
RELEASE_IN = struct.Struct("<QIIQ")
FSYNC_IN = struct.Struct("<QII")
FALLOCATE_IN = struct.Struct("<QQQII")  # fh, offset, length, mode, padding
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
KSTATFS = struct.Struct("<QQQQQIIII6I")  # 80 bytes
DIRENT_HEAD = struct.Struct("<QQII")  # ino, off, namelen, type

assert INIT_OUT.size == 64 and ATTR.size == 88 and KSTATFS.size == 80 and SETATTR_IN.size == 88
