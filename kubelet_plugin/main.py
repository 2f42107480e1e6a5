"""`flexgpu-kubelet-plugin`: the per-node daemon."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from driver.backend import GpuBackend
from driver.backend_errors import GpuBackendError
from kubelet_plugin.checkpoint import CheckpointStore
from kubelet_plugin.claim_source import ApiClaimSource
from kubelet_plugin.claim_status import ClaimStatusWriter
from kubelet_plugin.config import ConfigError, PluginConfig, load_config
from kubelet_plugin.grpc_server import PluginServer
from kubelet_plugin.health_monitor import HealthMonitor
from kubelet_plugin.node_devices import NodeDevices
from kubelet_plugin.node_events import NodeEventRecorder
from kubelet_plugin.policy_agent import PolicyAgent
from kubelet_plugin.prepare_lock import PrepareLock
from kubelet_plugin.preparer import ClaimPreparerImpl
from kubelet_plugin.slice_publisher import SlicePublisher
from kubelet_plugin.startup_reconcile import reconcile_at_start

log = logging.getLogger("flexgpu.kubelet_plugin")


def make_backend(config: PluginConfig) -> GpuBackend:
    if config.gpu_backend == "simulated":
        from driver.sim_backend import SimulatedBackend

        assert config.topology is not None  # enforced by PluginConfig
        return SimulatedBackend.from_topology(
            config.topology, config.node_name, state_path=config.data_dir / "simulated-gpus.json"
        )
    from driver.nvml_backend import NvmlBackend

    return NvmlBackend()


def make_api(config: PluginConfig) -> Any:
    from kubernetes import client
    from kubernetes import config as kube_config

    if config.kubeconfig is not None:
        return kube_config.new_client_from_config(config_file=str(config.kubeconfig))
    kube_config.load_incluster_config()
    return client.ApiClient()


def run(config: PluginConfig) -> int:
    try:
        backend = make_backend(config)
    except GpuBackendError as err:
        log.error("no GPUs: %s", err)
        return 1
    api = make_api(config)
    events = NodeEventRecorder(api, config.node_name)
    count = len(backend.list_gpus())
    devices = NodeDevices(
        backend, config.shared_gpu_indices(count), config.dynamic_mig_gpu_indices(count)
    )
    store = CheckpointStore(config.checkpoint_path)
    lock = PrepareLock(config.lock_path)
    claims = ApiClaimSource(api)
    status = ClaimStatusWriter(api, config.node_name)
    status.start()
    preparer = ClaimPreparerImpl(
        node_name=config.node_name,
        claims=claims,
        devices=devices,
        store=store,
        lock=lock,
        cdi_dir=config.cdi_dir,
        crash_at=os.environ.get("FLEXGPU_FAULT_CRASH_AT") or None,
        status=status,
    )
    with lock:
        reconcile_at_start(preparer, store, claims, events)
    publisher = SlicePublisher(api, config.node_name)
    publisher.set_devices(devices.slice_devices(), devices.counter_sets())
    publisher.start()
    health = HealthMonitor(
        backend,
        devices,
        config.node_name,
        on_unhealthy=lambda: publisher.set_devices(devices.slice_devices(), devices.counter_sets()),
    )
    health.start()
    agent = PolicyAgent(
        api,
        config.node_name,
        devices=devices,
        preparer=preparer,
        republish=lambda: publisher.set_devices(devices.slice_devices(), devices.counter_sets()),
    )
    preparer.on_unprepared = agent.poke
    agent.start()
    server = PluginServer(config, preparer, health)
    try:
        server.run_until_signal((signal.SIGTERM, signal.SIGINT))
    finally:
        # Slices stay: the kubelet removes them 30 s after we disconnect, and a restarted
        # plugin takes them over without a window where nothing is published.
        agent.stop()
        health.stop()
        publisher.stop()
        status.stop()
        backend.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"flexgpu-kubelet-plugin: {err}", file=sys.stderr)
        return 2
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
