"""Liveness probe for the plugin's container: ``python -m kubelet_plugin.probe``.

Reads the same flags and FLEXGPU_* variables as the plugin, then asks the plugin what the
kubelet would: GetInfo on the registration socket and an empty NodePrepareResources on the
DRA socket. Exit 0 when both answer in time, 1 otherwise (with the reason on stderr).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import grpc

from kubelet_plugin.config import ConfigError, load_config
from kubelet_plugin.proto.gen.dra.v1 import dra_pb2, dra_pb2_grpc
from kubelet_plugin.proto.gen.pluginregistration.v1 import (
    registration_pb2,
    registration_pb2_grpc,
)

TIMEOUT_S = 5.0


def probe(argv: Sequence[str] | None = None) -> str | None:
    """None when healthy, else what is wrong."""
    try:
        config = load_config(list(argv or []))
    except ConfigError as err:
        return str(err)
    try:
        with grpc.insecure_channel(f"unix://{config.registration_socket}") as channel:
            info = registration_pb2_grpc.RegistrationStub(channel).GetInfo(
                registration_pb2.InfoRequest(), timeout=TIMEOUT_S
            )
        with grpc.insecure_channel(f"unix://{info.endpoint}") as channel:
            dra_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_pb2.NodePrepareResourcesRequest(), timeout=TIMEOUT_S
            )
    except grpc.RpcError as err:
        return f"plugin not answering: {err.code().name}: {err.details()}"
    return None


def main() -> int:
    problem = probe(sys.argv[1:])
    if problem:
        print(f"flexgpu-kubelet-plugin probe: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
