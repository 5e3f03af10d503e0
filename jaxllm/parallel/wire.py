"""Length-prefixed frames over a TCP socket: what the step channel (multi-host TP) and the
remote data-parallel replicas both speak. Each frame is an 8-byte big-endian length and that
many bytes; a closed peer raises ConnectionError, never returns a short frame."""

from __future__ import annotations

import socket
import struct


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the other end closed the connection")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!Q", recv_exact(sock, 8))
    return recv_exact(sock, n)


def no_delay(sock: socket.socket) -> socket.socket:
    """Small frames go out at once (a step's messages are latency-bound)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
