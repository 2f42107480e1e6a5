"""Small helpers to expose plain Python methods as gRPC handlers of a named service.

The services are registered from their descriptors instead of through the generated
*_pb2_grpc modules so that one implementation can be served under several API versions, each
with its own (de)serialisers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.descriptor import FileDescriptor

Serializer = Callable[[Any], bytes]
Deserializer = Callable[[bytes], Any]


def service_name(file: FileDescriptor, service: str) -> str:
    """Full gRPC service name (the part of the method path before the method)."""
    name: str = file.services_by_name[service].full_name
    return name


def unary(
    behaviour: Callable[[Any, grpc.ServicerContext], Any],
    deserialize: Deserializer,
    serialize: Serializer,
) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=deserialize, response_serializer=serialize
    )


def server_stream(
    behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]],
    deserialize: Deserializer,
    serialize: Serializer,
) -> grpc.RpcMethodHandler:
    return grpc.unary_stream_rpc_method_handler(
        behaviour, request_deserializer=deserialize, response_serializer=serialize
    )


def service(name: str, methods: dict[str, grpc.RpcMethodHandler]) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(name, methods)


def serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data
