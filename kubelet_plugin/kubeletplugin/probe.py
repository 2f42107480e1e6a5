"""Is a DRA plugin answering? Asks what the kubelet would ask.

GetInfo on the registration socket, then an empty NodePrepareResources on the DRA endpoint
that GetInfo names (an empty request prepares nothing).
"""

from __future__ import annotations

from pathlib import Path

import grpc

from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2, dra_pb2_grpc
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
    registration_pb2,
    registration_pb2_grpc,
)

TIMEOUT_S = 5.0


def probe(registration_socket: Path, timeout: float = TIMEOUT_S) -> str | None:
    """None when both services answer within timeout, else what is wrong."""
    try:
        with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
            info = registration_pb2_grpc.RegistrationStub(channel).GetInfo(
                registration_pb2.InfoRequest(), timeout=timeout
            )
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            dra_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(), timeout=timeout
            )
    except grpc.RpcError as err:
        return f"plugin not answering: {err.code().name}: {err.details()}"
    return None
