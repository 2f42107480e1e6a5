"""Plain Python methods exposed as gRPC methods of a named service (grpcio handlers).

The services are registered from their descriptors instead of through the generated
*_pb2_grpc modules so that one implementation can be served under several API versions, each
with its own (de)serialisers. Unary behaviours are blocking functions (prepare takes file
locks, writes checkpoints, calls device libraries): grpc.aio runs a handler that is not a
coroutine function on the server's thread pool, so the event loop goes on serving streams and
other connections meanwhile.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import FileDescriptor

# The most a request may carry, gRPC's default (4 MiB), set explicitly: a real kubelet request
# is a few hundred bytes per claim. The transport refuses a larger message with
# RESOURCE_EXHAUSTED before it is parsed (grpc.max_receive_message_length).
MAX_REQUEST_BYTES = 4 * 1024 * 1024

Behaviour = Callable[[Any], Any]
Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]
StreamMethod = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Any]]


def service_name(file: FileDescriptor, service: str) -> str:
    """Full gRPC service name (the part of the method path before the method)."""
    name: str = file.services_by_name[service].full_name
    return name


def serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def unary(
    behaviour: Behaviour, deserialize: Deserializer, serializer: Serializer = serialize
) -> grpc.RpcMethodHandler:
    """A unary method: behaviour(request) runs on a worker thread of the server's pool."""

    def handle(request: Any, context: object) -> Any:
        return behaviour(request)

    return grpc.unary_unary_rpc_method_handler(
        handle, request_deserializer=deserialize, response_serializer=serializer
    )


def server_stream(
    method: StreamMethod, deserialize: Deserializer, serializer: Serializer = serialize
) -> grpc.RpcMethodHandler:
    """A server-streaming method: an async generator on the server's event loop (an open
    stream holds no worker thread)."""
    return grpc.unary_stream_rpc_method_handler(
        method, request_deserializer=deserialize, response_serializer=serializer
    )


def service(name: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(name, methods)
