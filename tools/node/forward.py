"""Forwards TCP connections made inside the node's network namespace to an address of this
machine: it listens there (the socket is made after joining that namespace) and connects out
from this machine's own namespace. The node's kubelet and pods reach the local API server
through it at the `kubernetes` Service address.

    python -m tools.node.forward <holder pid> <listen ip> <listen port> <target ip> <target port>
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import socket
import sys

_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


def listen_in(holder_pid: int, host: str, port: int) -> socket.socket:
    """A listening socket in the network namespace of ``holder_pid``; the calling thread
    returns to its own namespace afterwards."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/proc/{holder_pid}/ns/net", os.O_RDONLY)
    try:
        _setns(target)
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            sock.setblocking(False)
        finally:
            _setns(own)
    finally:
        os.close(own)
        os.close(target)
    return sock


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()


async def serve(sock: socket.socket, target_host: str, target_port: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(target_host, target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))

    server = await asyncio.start_server(handle, sock=sock)
    print(f"forwarding {sock.getsockname()} -> {target_host}:{target_port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    pid, host, port, target_host, target_port = argv
    sock = listen_in(int(pid), host, int(port))
    asyncio.run(serve(sock, target_host, int(target_port)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
