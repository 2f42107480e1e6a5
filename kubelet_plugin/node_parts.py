"""The parts the kubelet plugin's start-up (``kubelet_plugin.main``) wires together, each made
from the plugin's settings: the GPU backend, the API client, what the API server decides
(health taints, binding conditions), the driver's CDI edits, MPS daemon pods and the slice
publisher. Their modules are imported inside each function: the plugin serves its sockets
before any of them is loaded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flexgpu.kubelet_plugin.config import PluginConfig

if TYPE_CHECKING:
    from flexgpu.driver.backend import GpuBackend
    from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
    from flexgpu.kubelet_plugin.api.kube_api import KubeApi
    from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
    from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
    from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher

log = logging.getLogger("flexgpu.kubelet_plugin")


def make_backend(config: PluginConfig) -> GpuBackend:
    if config.gpu_backend == "simulated":
        from flexgpu.driver.sim_backend import SimulatedBackend
        from flexgpu.kubelet_plugin.fault_injection import arm_backend_failures

        assert config.topology is not None  # enforced by PluginConfig
        sim = SimulatedBackend.from_topology(
            config.topology, config.node_name, state_path=config.data_dir / "simulated-gpus.json"
        )
        # Fault tests: the simulated GPUs fail the next calls of the named operations.
        arm_backend_failures(sim.faults)
        return sim
    from flexgpu.driver.nvml_backend import NvmlBackend

    if config.driver_root is not None:
        from flexgpu.kubelet_plugin.devices.driver_edits import load_nvml

        load_nvml(config.driver_root)
    return NvmlBackend()


def make_api(config: PluginConfig) -> KubeApi:
    from flexgpu.kubelet_plugin.api.kube_api import KubeApi

    qps, burst = config.kube_api_qps, config.kube_api_burst
    if config.kubeconfig is not None:
        return KubeApi.from_kubeconfig(config.kubeconfig, qps=qps, burst=burst)
    return KubeApi.in_cluster(qps=qps, burst=burst)


def health_taints(config: PluginConfig, api: KubeApi) -> bool:
    """Whether GPU faults are published as device taints: ``auto`` asks the server, since
    taints are on by default from Kubernetes 1.36 and an API server without them drops them,
    which would leave a faulty GPU looking healthy; there the GPU is withdrawn instead."""
    if config.health_taints != "auto":
        return config.health_taints == "on"
    try:
        minor = int("".join(c for c in str(api.get("/version").get("minor", "")) if c.isdigit()))
    except Exception as err:  # unknown server: withdrawing is right on every release
        log.warning("cannot read the server version (%s); faulty GPUs are withdrawn", err)
        return False
    return minor >= 36


def binding_conditions(config: PluginConfig, api: KubeApi) -> bool:
    """Whether on-demand MIG partitions carry binding conditions. ``auto``: Kubernetes 1.36+
    (beta, on by default) and the server keeps the fields (a dry-run probe: the gate may be
    off); before 1.36, and on ``off``, partitions are created in prepare as before."""
    if config.binding_conditions != "auto":
        return config.binding_conditions == "on"
    try:
        minor = int("".join(c for c in str(api.get("/version").get("minor", "")) if c.isdigit()))
    except Exception as err:  # unknown server: prepare creates partitions, as on every release
        log.warning("cannot read the server version (%s); no binding conditions", err)
        return False
    if minor < 36:
        return False
    from flexgpu.kubelet_plugin.agents.binding_watch import server_keeps_binding_conditions

    on = server_keeps_binding_conditions(api, config.node_name)
    log.info("binding conditions for on-demand MIG: %s", "on" if on else "off (not served)")
    return on


def mps_daemon_pods(
    config: PluginConfig,
    api: KubeApi,
    backend: GpuBackend,
    edits: dict[str, Any],
    events: Callable[[str, str], None],
) -> MpsDaemonPods | None:
    """MPS control daemons as pods of their own (--mps-namespace), or None: the backend's."""
    if config.mps_namespace is None or config.driver_root is None or config.mps_image is None:
        return None
    from flexgpu.kubelet_plugin.agents.mps_pod_spec import DEFAULT_RESOURCES
    from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
    from flexgpu.kubelet_plugin.devices.driver_edits import library_paths

    libraries = library_paths(config.driver_root, edits)
    return MpsDaemonPods(
        api,
        backend,
        node_name=config.node_name,
        namespace=config.mps_namespace,
        image=config.mps_image,
        mps_root=config.mps_root,
        driver_root=config.driver_root,
        host_driver_root=config.host_driver_root,
        libraries=libraries,
        events=events,
        owner_pod=config.pod_name,
        priority_class=config.mps_priority_class,
        resources=(
            config.mps_resources.as_pod_resources()
            if config.mps_resources is not None
            else DEFAULT_RESOURCES
        ),
    )


def mps_gpus(store: CheckpointStore) -> set[int]:
    """GPUs whose MPS daemon a prepared share uses."""
    return {
        r.created.mps_share.gpu_index
        for r in store.checkpoint().claims.values()
        if r.created.mps_share is not None and r.created.mps_share.gpu_index is not None
    }


def node_driver_edits(config: PluginConfig, devices: NodeDevices) -> dict[str, Any]:
    """The driver's common CDI edits over the driver root, and device nodes found there;
    without a driver root, device nodes only (from /dev)."""
    from flexgpu.kubelet_plugin.devices import driver_edits
    from flexgpu.kubelet_plugin.devices.device_nodes import DeviceNodes

    if config.driver_root is None:
        if config.gpu_backend == "nvml":
            log.warning(
                "no --driver-root (FLEXGPU_DRIVER_ROOT): CDI specs carry device nodes only, "
                "no driver libraries or programs"
            )
        return {}
    host_root = config.host_driver_root or config.driver_root
    edits = driver_edits.node_edits(
        driver_root=config.driver_root,
        host_driver_root=host_root,
        data_dir=config.data_dir,
        own_hook=config.nvidia_cdi_hook,
        generator=config.cdi_generator,
    )
    devices.nodes = DeviceNodes(config.driver_root, host_root, with_control_nodes=False)
    return edits


def make_publisher(config: PluginConfig, api: KubeApi) -> SlicePublisher:
    from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher

    return SlicePublisher(api, config.node_name)
