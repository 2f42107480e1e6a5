"""Is a DRA plugin answering? Asks what the kubelet would ask.

GetInfo on the registration socket, then an empty NodePrepareResources on the DRA endpoint
that GetInfo names (an empty request prepares nothing).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
    registration_pb2,
)

TIMEOUT_S = 5.0


def _call(socket: str, path: str, request: Any, reply: Any, timeout: float) -> Any:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(
            path, request_serializer=h.serialize, response_deserializer=reply.FromString
        )
        return call(request, timeout=timeout)


def probe(registration_socket: Path, timeout: float = TIMEOUT_S) -> str | None:
    """None when both services answer within timeout, else what is wrong."""
    deadline = time.monotonic() + 2 * timeout
    try:
        info = _call(
            str(registration_socket),
            f"/{h.service_name(registration_pb2.DESCRIPTOR, 'Registration')}/GetInfo",
            registration_pb2.InfoRequest(),
            registration_pb2.PluginInfo,
            timeout,
        )
        _call(
            info.endpoint,
            f"/{h.service_name(dra_pb2.DESCRIPTOR, 'DRAPlugin')}/NodePrepareResources",
            dra_pb2.NodePrepareResourcesRequest(),
            dra_pb2.NodePrepareResourcesResponse,
            max(0.1, min(timeout, deadline - time.monotonic())),
        )
    except grpc.RpcError as err:
        code = err.code() if isinstance(err, grpc.Call) else None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return f"plugin not answering: no reply within {timeout:g} s"
        details = err.details() if isinstance(err, grpc.Call) else str(err)
        return f"plugin not answering: {code.name if code else 'error'}: {details}"
    return None
