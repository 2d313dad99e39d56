"""The NBD wire format: constants and (de)serialisers for the fixed-newstyle handshake and simple replies.

Kept apart from the server so the byte layout (big-endian, as in the upstream NBD protocol document,
https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md) can be read and tested on its own.
Only what the server speaks is here: fixed newstyle negotiation and simple (not structured) replies.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

# --- handshake ---------------------------------------------------------------------------------------------
NBDMAGIC = 0x4E42444D41474943  # "NBDMAGIC"
IHAVEOPT = 0x49484156454F5054  # "IHAVEOPT"
OPT_REPLY_MAGIC = 0x0003E889045565A9

# server handshake flags
FLAG_FIXED_NEWSTYLE = 1 << 0
FLAG_NO_ZEROES = 1 << 1
# client flags
FLAG_C_FIXED_NEWSTYLE = 1 << 0
FLAG_C_NO_ZEROES = 1 << 1

# options
OPT_EXPORT_NAME = 1
OPT_ABORT = 2
OPT_LIST = 3
OPT_STARTTLS = 5
OPT_INFO = 6
OPT_GO = 7
OPT_STRUCTURED_REPLY = 8
OPT_LIST_META_CONTEXT = 9
OPT_SET_META_CONTEXT = 10

# option reply types
REP_ACK = 1
REP_SERVER = 2
REP_INFO = 3
REP_FLAG_ERROR = 1 << 31
REP_ERR_UNSUP = REP_FLAG_ERROR | 1
REP_ERR_POLICY = REP_FLAG_ERROR | 2
REP_ERR_INVALID = REP_FLAG_ERROR | 3
REP_ERR_PLATFORM = REP_FLAG_ERROR | 4
REP_ERR_TLS_REQD = REP_FLAG_ERROR | 5
REP_ERR_UNKNOWN = REP_FLAG_ERROR | 6
REP_ERR_SHUTDOWN = REP_FLAG_ERROR | 7
REP_ERR_BLOCK_SIZE_REQD = REP_FLAG_ERROR | 8
REP_ERR_TOO_BIG = REP_FLAG_ERROR | 9

# NBD_REP_INFO item types
INFO_EXPORT = 0
INFO_NAME = 1
INFO_DESCRIPTION = 2
INFO_BLOCK_SIZE = 3

# transmission flags
TFLAG_HAS_FLAGS = 1 << 0
TFLAG_READ_ONLY = 1 << 1
TFLAG_SEND_FLUSH = 1 << 2
TFLAG_SEND_FUA = 1 << 3
TFLAG_ROTATIONAL = 1 << 4
TFLAG_SEND_TRIM = 1 << 5
TFLAG_SEND_WRITE_ZEROES = 1 << 6
TFLAG_SEND_DF = 1 << 7
TFLAG_CAN_MULTI_CONN = 1 << 8
TFLAG_SEND_RESIZE = 1 << 9
TFLAG_SEND_CACHE = 1 << 10
TFLAG_SEND_FAST_ZERO = 1 << 11

# --- transmission ------------------------------------------------------------------------------------------
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698

CMD_READ = 0
CMD_WRITE = 1
CMD_DISC = 2
CMD_FLUSH = 3
CMD_TRIM = 4
CMD_CACHE = 5
CMD_WRITE_ZEROES = 6
CMD_BLOCK_STATUS = 7
CMD_RESIZE = 8

CMD_FLAG_FUA = 1 << 0
CMD_FLAG_NO_HOLE = 1 << 1
CMD_FLAG_DF = 1 << 2
CMD_FLAG_REQ_ONE = 1 << 3
CMD_FLAG_FAST_ZERO = 1 << 4

# errors (NBD numbers, equal to the Linux errno values)
EPERM = 1
EIO = 5
ENOMEM = 12
EINVAL = 22
ENOSPC = 28
EOVERFLOW = 75
ENOTSUP = 95
ESHUTDOWN = 108

# --- structs -----------------------------------------------------------------------------------------------
SERVER_HELLO = struct.Struct(">QQH")  # NBDMAGIC, IHAVEOPT, handshake flags
CLIENT_FLAGS = struct.Struct(">I")
OPTION_HEADER = struct.Struct(">QII")  # IHAVEOPT, option, length
OPTION_REPLY = struct.Struct(">QIII")  # magic, option, reply type, length
EXPORT_NAME_REPLY = struct.Struct(">QH")  # size, transmission flags (+124 zero bytes unless NO_ZEROES)
INFO_EXPORT_ITEM = struct.Struct(">HQH")  # INFO_EXPORT, size, transmission flags
INFO_BLOCK_SIZE_ITEM = struct.Struct(">HIII")  # INFO_BLOCK_SIZE, minimum, preferred, maximum
REQUEST = struct.Struct(">IHHQQI")  # magic, command flags, type, cookie, offset, length
SIMPLE_REPLY = struct.Struct(">IIQ")  # magic, error, cookie

# A server refuses option payloads larger than this (they carry names and short lists only).
MAX_OPTION_LENGTH = 64 * 1024


@dataclass(frozen=True, slots=True)
class GoRequest:
    """The payload of NBD_OPT_INFO / NBD_OPT_GO: an export name and the info items the client asks for."""

    name: str
    info_requests: tuple[int, ...]


def server_hello() -> bytes:
    return SERVER_HELLO.pack(NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)


def option_reply(option: int, reply_type: int, data: bytes = b"") -> bytes:
    return OPTION_REPLY.pack(OPT_REPLY_MAGIC, option, reply_type, len(data)) + data


def parse_go(data: bytes) -> GoRequest:
    """Parse an NBD_OPT_INFO/NBD_OPT_GO payload; raises ValueError when it is malformed."""
    if len(data) < 6:
        raise ValueError("NBD_OPT_GO payload shorter than 6 bytes")
    (name_len,) = struct.unpack_from(">I", data, 0)
    if 4 + name_len + 2 > len(data):
        raise ValueError("NBD_OPT_GO name length runs past the payload")
    name = data[4 : 4 + name_len].decode("utf-8", "strict")
    (count,) = struct.unpack_from(">H", data, 4 + name_len)
    rest = data[4 + name_len + 2 :]
    if len(rest) != 2 * count:
        raise ValueError("NBD_OPT_GO information request count does not match the payload")
    return GoRequest(name, struct.unpack(f">{count}H", rest))


def info_export(size: int, flags: int) -> bytes:
    return INFO_EXPORT_ITEM.pack(INFO_EXPORT, size, flags)


def info_block_size(minimum: int, preferred: int, maximum: int) -> bytes:
    return INFO_BLOCK_SIZE_ITEM.pack(INFO_BLOCK_SIZE, minimum, preferred, maximum)


def info_name(name: str) -> bytes:
    return struct.pack(">H", INFO_NAME) + name.encode()


def server_entry(name: str) -> bytes:
    """The payload of an NBD_REP_SERVER reply to NBD_OPT_LIST."""
    raw = name.encode()
    return struct.pack(">I", len(raw)) + raw


def export_name_reply(size: int, flags: int, no_zeroes: bool) -> bytes:
    return EXPORT_NAME_REPLY.pack(size, flags) + (b"" if no_zeroes else bytes(124))
