"""A minimal blocking NBD client for tests that need to speak raw protocol (bad magic, pipelining, option
replies) where qemu-io would refuse or hide the bytes. Run it from ``trio.to_thread`` in async tests."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from aenv_node.storage.frontends import nbd_protocol as P


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        data = sock.recv(n)
        if not data:
            raise EOFError("server closed the connection")
        chunks.append(data)
        n -= len(data)
    return b"".join(chunks)


@dataclass
class OptionReply:
    option: int
    type: int
    data: bytes


class RawClient:
    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.size = 0
        self.flags = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RawClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- negotiation ---
    def hello(self, client_flags: int = P.FLAG_C_FIXED_NEWSTYLE | P.FLAG_C_NO_ZEROES) -> int:
        magic, opt_magic, hflags = P.SERVER_HELLO.unpack(recv_exactly(self.sock, P.SERVER_HELLO.size))
        assert magic == P.NBDMAGIC and opt_magic == P.IHAVEOPT
        self.sock.sendall(P.CLIENT_FLAGS.pack(client_flags))
        return hflags

    def send_option(self, option: int, data: bytes = b"") -> None:
        self.sock.sendall(P.OPTION_HEADER.pack(P.IHAVEOPT, option, len(data)) + data)

    def read_option_reply(self) -> OptionReply:
        magic, option, rtype, length = P.OPTION_REPLY.unpack(recv_exactly(self.sock, P.OPTION_REPLY.size))
        assert magic == P.OPT_REPLY_MAGIC, hex(magic)
        return OptionReply(option, rtype, recv_exactly(self.sock, length) if length else b"")

    def option_until_ack(self, option: int, data: bytes = b"") -> list[OptionReply]:
        self.send_option(option, data)
        replies = []
        while True:
            r = self.read_option_reply()
            replies.append(r)
            if r.type == P.REP_ACK or r.type & P.REP_FLAG_ERROR:
                return replies

    @staticmethod
    def go_payload(name: str = "", infos: tuple[int, ...] = ()) -> bytes:
        raw = name.encode()
        return struct.pack(">I", len(raw)) + raw + struct.pack(">H", len(infos)) + struct.pack(f">{len(infos)}H", *infos)

    def go(self, name: str = "") -> list[OptionReply]:
        self.hello()
        replies = self.option_until_ack(P.OPT_GO, self.go_payload(name, (P.INFO_BLOCK_SIZE,)))
        for r in replies:
            if r.type == P.REP_INFO and struct.unpack_from(">H", r.data)[0] == P.INFO_EXPORT:
                _, self.size, self.flags = P.INFO_EXPORT_ITEM.unpack(r.data)
        assert replies[-1].type == P.REP_ACK, replies
        return replies

    # --- transmission ---
    def send_request(self, cmd: int, offset: int, length: int, cookie: int = 1, flags: int = 0, data: bytes = b"",
                     magic: int = P.REQUEST_MAGIC) -> None:
        self.sock.sendall(P.REQUEST.pack(magic, flags, cmd, cookie, offset, length) + data)

    def read_reply(self, read_length: int = 0) -> tuple[int, int, bytes]:
        """Returns (error, cookie, data); ``data`` is read only when the reply carries no error."""
        magic, err, cookie = P.SIMPLE_REPLY.unpack(recv_exactly(self.sock, P.SIMPLE_REPLY.size))
        assert magic == P.SIMPLE_REPLY_MAGIC, hex(magic)
        data = recv_exactly(self.sock, read_length) if read_length and not err else b""
        return err, cookie, data

    def read(self, offset: int, length: int, cookie: int = 1) -> tuple[int, bytes]:
        self.send_request(P.CMD_READ, offset, length, cookie)
        err, c, data = self.read_reply(length)
        assert c == cookie
        return err, data

    def write(self, offset: int, data: bytes, cookie: int = 2, flags: int = 0) -> int:
        self.send_request(P.CMD_WRITE, offset, len(data), cookie, flags, data)
        err, c, _ = self.read_reply()
        assert c == cookie
        return err

    def simple(self, cmd: int, offset: int = 0, length: int = 0, cookie: int = 3, flags: int = 0) -> int:
        self.send_request(cmd, offset, length, cookie, flags)
        err, c, _ = self.read_reply()
        assert c == cookie
        return err

    def disconnect(self) -> None:
        self.send_request(P.CMD_DISC, 0, 0, 99)

    def at_eof(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
