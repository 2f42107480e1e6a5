"""Is a DRA plugin answering? Asks what the kubelet would ask.

GetInfo on the registration socket, then an empty NodePrepareResources on the DRA endpoint
that GetInfo names (an empty request prepares nothing).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from grpclib.client import Channel, UnaryUnaryMethod
from grpclib.exceptions import GRPCError, StreamTerminatedError

from flexgpu.kubelet_plugin.kubeletplugin import grpc_handlers as h
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.dra.v1 import dra_pb2
from flexgpu.kubelet_plugin.kubeletplugin.proto.gen.pluginregistration.v1 import (
    registration_pb2,
)

TIMEOUT_S = 5.0


async def _call(socket: str, path: str, request: Any, reply: Any, timeout: float) -> Any:
    channel = Channel(path=socket)
    try:
        call = UnaryUnaryMethod(channel, path, type(request), reply)
        return await call(request, timeout=timeout)
    finally:
        channel.close()


async def _ask(registration_socket: Path, timeout: float) -> None:
    info = await _call(
        str(registration_socket),
        f"/{h.service_name(registration_pb2.DESCRIPTOR, 'Registration')}/GetInfo",
        registration_pb2.InfoRequest(),
        registration_pb2.PluginInfo,
        timeout,
    )
    await _call(
        info.endpoint,
        f"/{h.service_name(dra_pb2.DESCRIPTOR, 'DRAPlugin')}/NodePrepareResources",
        dra_pb2.NodePrepareResourcesRequest(),
        dra_pb2.NodePrepareResourcesResponse,
        timeout,
    )


def probe(registration_socket: Path, timeout: float = TIMEOUT_S) -> str | None:
    """None when both services answer within timeout, else what is wrong."""
    try:
        asyncio.run(asyncio.wait_for(_ask(registration_socket, timeout), 2 * timeout))
    except GRPCError as err:
        return f"plugin not answering: {err.status.name}: {err.message}"
    except (OSError, StreamTerminatedError) as err:
        return f"plugin not answering: {type(err).__name__}: {err}"
    except TimeoutError:
        return f"plugin not answering: no reply within {timeout:g} s"
    return None
