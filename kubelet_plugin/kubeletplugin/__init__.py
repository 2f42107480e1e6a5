"""Serve a DRA driver to the kubelet: the kubelet-plugin protocol, free of any device logic.

The Python counterpart of upstream's ``k8s.io/dynamic-resource-allocation/kubeletplugin``
(slice publishing aside): plugin registration (pluginregistration v1), the DRAPlugin service
(v1 and v1beta1 from one implementation), the DRAResourceHealth streams (v1 and v1alpha1),
and the sockets' lifecycle (per-pod sockets for rolling updates, stale sockets removed, both
removed on stop). A driver implements :class:`DraDriver` (and optionally
:class:`HealthSource`) with plain dataclasses; no protobuf type reaches it::

    server = serve(driver, Options(driver_name="gpu.example.com",
                                   plugin_data_dir=Path("/var/lib/kubelet/plugins/gpu.example.com"),
                                   registrar_dir=Path("/var/lib/kubelet/plugins_registry")))
    ...
    server.stop()

Everything not named here is this package's own business. It imports nothing of the GPU
driver (an import-linter contract in pyproject.toml checks that).
"""

from flexgpu.kubelet_plugin.kubeletplugin.claims import (
    ClaimRef,
    DraDriver,
    PreparedDevice,
    PrepareResult,
    UnprepareResult,
)
from flexgpu.kubelet_plugin.kubeletplugin.health import DeviceHealth, HealthSource, HealthStatus
from flexgpu.kubelet_plugin.kubeletplugin.registration import RegistrationState
from flexgpu.kubelet_plugin.kubeletplugin.server import Options, Server, serve
from flexgpu.kubelet_plugin.kubeletplugin.sockets import MAX_SOCKET_PATH_BYTES, ServerError

__all__ = [
    "MAX_SOCKET_PATH_BYTES",
    "ClaimRef",
    "DeviceHealth",
    "DraDriver",
    "HealthSource",
    "HealthStatus",
    "Options",
    "PrepareResult",
    "PreparedDevice",
    "RegistrationState",
    "Server",
    "ServerError",
    "UnprepareResult",
    "serve",
]
