"""Plain Python methods exposed as gRPC methods of a named service (grpclib handlers).

The services are registered from their descriptors instead of through generated stubs so that
one implementation can be served under several API versions, each with its own message types.
Unary behaviours are blocking functions (prepare takes file locks, writes checkpoints, calls
device libraries): each call runs on a worker thread of the server's pool while the event
loop goes on serving other connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FileDescriptor
from grpclib.const import Cardinality, Handler, Status
from grpclib.encoding.proto import ProtoCodec
from grpclib.exceptions import GRPCError
from grpclib.server import Stream

# The most a request may carry, as gRPC servers default to (4 MiB): a real kubelet request is
# a few hundred bytes per claim; anything far larger is refused before it is parsed.
MAX_REQUEST_BYTES = 4 * 1024 * 1024

Behaviour = Callable[[Any], Any]
Convert = Callable[[Any], Any]
StreamMethod = Callable[["Stream[Any, Any]"], Any]


def service_name(file: FileDescriptor, service: str) -> str:
    """Full gRPC service name (the part of the method path before the method)."""
    name: str = file.services_by_name[service].full_name
    return name


class BoundedProtoCodec(ProtoCodec):
    """Protobuf codec that refuses requests over MAX_REQUEST_BYTES with RESOURCE_EXHAUSTED."""

    def decode(self, data: bytes, message_type: Any) -> Any:
        if len(data) > MAX_REQUEST_BYTES:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"request of {len(data)} bytes is over the limit of {MAX_REQUEST_BYTES} bytes",
            )
        return super().decode(data, message_type)


class Calls:
    """Runs blocking behaviours on a thread pool and counts the calls in flight, so that a
    stopping server can let them finish (its grace period) before it cancels the rest."""

    def __init__(self, workers: int, name: str) -> None:
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        self._in_flight = 0
        self._idle: asyncio.Event | None = None

    async def run(self, behaviour: Behaviour, request: Any) -> Any:
        if self._idle is None:
            self._idle = asyncio.Event()
        self._in_flight += 1
        self._idle.clear()
        try:
            return await asyncio.get_running_loop().run_in_executor(self.pool, behaviour, request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def drained(self, timeout: float) -> bool:
        """Waits (on the server's loop) until no call is in flight, at most timeout seconds."""
        if not self._in_flight or self._idle is None:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def shutdown(self) -> None:
        # Workers still busy past the grace period are left to finish on their own.
        self.pool.shutdown(wait=False, cancel_futures=True)


def unary(
    calls: Calls,
    behaviour: Behaviour,
    request_type: Any,
    reply_type: Any,
    convert: Convert | None = None,
) -> Handler:
    """A unary method: parse the request, run behaviour(request) on a worker thread, send its
    reply (through convert when the reply type is another API version's)."""

    async def handle(stream: Stream[Any, Any]) -> None:
        request = await stream.recv_message()
        reply = await calls.run(behaviour, request)
        await stream.send_message(convert(reply) if convert else reply)

    return Handler(handle, Cardinality.UNARY_UNARY, request_type, reply_type)


def server_stream(method: StreamMethod, request_type: Any, reply_type: Any) -> Handler:
    """A server-streaming method: `method` is a coroutine function taking the stream."""
    return Handler(method, Cardinality.UNARY_STREAM, request_type, reply_type)


@dataclass(frozen=True)
class Service:
    """One gRPC service's methods, in the shape grpclib's Server serves (`__mapping__`)."""

    name: str
    methods: Mapping[str, Handler]

    def __mapping__(self) -> dict[str, Handler]:
        return {f"/{self.name}/{method}": handler for method, handler in self.methods.items()}
