"""`flexgpu-kubelet-plugin`: the per-node daemon.

Start-up order: the registration and DRA sockets are served first, from what serving needs
(settings, gRPC); GPU discovery, the API client, start-up reconcile and everything else
follow, their modules imported only then. Until reconcile has finished, a prepare or
unprepare waits in the start-up gate, the first stage of the claim pipeline (its stages in
order: ``claim_stages``); slices, health events, node policies and claim status start after
it.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from flexgpu.driver.log_format import configure_logging
from flexgpu.kubelet_plugin import node_parts
from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline, Stage
from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate
from flexgpu.kubelet_plugin.config import ConfigError, PluginConfig
from flexgpu.kubelet_plugin.config_flags import load_config
from flexgpu.kubelet_plugin.kubeletplugin import Server
from flexgpu.kubelet_plugin.malloc_arenas import limit_malloc_arenas

if TYPE_CHECKING:
    from flexgpu.kubelet_plugin.api.device_plugin_guard import DevicePluginGuard
    from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
    from flexgpu.kubelet_plugin.claims.driver_change import DriverChange
    from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher

log = logging.getLogger("flexgpu.kubelet_plugin")


class StartupFailed(RuntimeError):
    """The plugin cannot serve this node (no GPUs, no credentials)."""


class NodeReadiness:
    """What /readyz answers: the plugin serves prepares and its slices went out once."""

    def __init__(self, gate: StartupGate) -> None:
        self._gate = gate
        self.publisher: SlicePublisher | None = None
        self.guard: DevicePluginGuard | None = None

    def __call__(self) -> str | None:
        if self.guard is not None and self.guard.waiting:
            return self.guard.waiting
        if not self._gate.ready:
            return "starting: prepares are not served yet"
        publisher = self.publisher
        if publisher is None or not publisher.published:
            why = publisher.last_error if publisher is not None else None
            return "ResourceSlices not published yet" + (f": {why}" if why else "")
        return None


def claim_stages(
    gate: StartupGate,
    update_tenants: Callable[[], object],
    node_name: str,
    observed: bool,
    driver_change: DriverChange | None = None,
) -> list[Stage]:
    """Every prepare and unprepare passes these stages in this order, then the preparer."""
    from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantTracking

    stages: list[Stage] = [gate]  # held until start-up reconcile is done
    if observed:  # timed, its failed claims counted by reason
        from flexgpu.kubelet_plugin.observe.metrics import CallMetrics

        stages.append(CallMetrics(node_name))
    if driver_change is not None:  # no spec for a driver that is gone (with a driver root)
        stages.append(driver_change)
    stages.append(TenantTracking(update_tenants))  # shared GPUs' tenant follows the records
    return stages


def start_node(
    config: PluginConfig,
    gate: StartupGate,
    pipeline: ClaimPipeline,
    readiness: NodeReadiness | None = None,
) -> Callable[[], None]:
    """Everything after the sockets: completes the claim pipeline that ``gate`` begins, and
    returns what stops it all again."""
    from flexgpu.driver.backend_errors import GpuBackendError
    from flexgpu.driver.driver_version import read_fingerprint
    from flexgpu.kubelet_plugin.agents.health_monitor import HealthMonitor
    from flexgpu.kubelet_plugin.agents.mig_ownership import MigOwnership
    from flexgpu.kubelet_plugin.agents.policy_agent import PolicyAgent
    from flexgpu.kubelet_plugin.api.credentials import KubeConfigError
    from flexgpu.kubelet_plugin.api.node_events import NodeEventRecorder
    from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
    from flexgpu.kubelet_plugin.claims.claim_objects import ClaimObjects
    from flexgpu.kubelet_plugin.claims.claim_source import ApiClaimSource
    from flexgpu.kubelet_plugin.claims.claim_status import ClaimStatusWriter
    from flexgpu.kubelet_plugin.claims.driver_change import DriverChange
    from flexgpu.kubelet_plugin.claims.metadata_files import FOLDER as METADATA_FOLDER
    from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock, gpu_key
    from flexgpu.kubelet_plugin.claims.preparer import ClaimPreparerImpl
    from flexgpu.kubelet_plugin.claims.startup_reconcile import reconcile_at_start
    from flexgpu.kubelet_plugin.claims.tenant_attribute import TenantAttribute
    from flexgpu.kubelet_plugin.devices.driver_edits import DriverEditsError
    from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
    from flexgpu.kubelet_plugin.fault_injection import crash_step
    from flexgpu.kubelet_plugin.observe.metrics_settings import (
        MetricsSettingError,
        settings_from_env,
    )

    try:
        metric_settings = settings_from_env(os.environ)
        backend = node_parts.make_backend(config)
    except MetricsSettingError as err:
        raise StartupFailed(str(err)) from None
    except GpuBackendError as err:
        raise StartupFailed(f"no GPUs: {err}") from None
    except DriverEditsError as err:
        raise StartupFailed(str(err)) from None
    # Without a metrics port nothing would read the counters: prometheus_client, the
    # counting backend and the pipeline's metrics stage are left out (about 6 MiB resident).
    observed = metric_settings.port is not None
    if observed:
        from flexgpu.kubelet_plugin.observe.observed_backend import ObservedBackend

        backend = ObservedBackend(backend, config.node_name)
    try:
        api = node_parts.make_api(config)
    except KubeConfigError as err:
        backend.close()
        raise StartupFailed(str(err)) from None
    events = NodeEventRecorder(api, config.node_name)
    count = len(backend.list_gpus())
    devices = NodeDevices(
        backend,
        config.shared_gpu_indices(count),
        config.dynamic_mig_gpu_indices(count),
        health_taints=node_parts.health_taints(config, api),
        binding_conditions=node_parts.binding_conditions(config, api),
        publish_tenants=config.shared_gpu_tenants == "namespace",
    )
    # Read before the edits are generated: a change in between is seen, never missed.
    installed = None if config.driver_root is None else read_fingerprint(config.driver_root)
    try:
        driver_edits = node_parts.node_driver_edits(config, devices)
    except RuntimeError as err:
        api.close()
        backend.close()
        raise StartupFailed(str(err)) from None
    store = CheckpointStore(config.checkpoint_path)
    lock = PrepareLock(config.lock_path)
    objects = ClaimObjects()
    claims = ApiClaimSource(api, objects)
    status = ClaimStatusWriter(api, config.node_name, objects)
    preparer = ClaimPreparerImpl(
        node_name=config.node_name,
        claims=claims,
        devices=devices,
        store=store,
        lock=lock,
        cdi_dir=config.cdi_dir,
        crash_at=crash_step(),
        status=status,
        driver_edits=driver_edits,
        # Under the data dir, which is the same path on the host (the runtime mounts from it).
        metadata_dir=config.data_dir / METADATA_FOLDER,
    )
    preparer.shared_gpu_tenants = config.shared_gpu_tenants
    mps_pods = node_parts.mps_daemon_pods(config, api, backend, driver_edits, events)
    if mps_pods is not None:
        preparer.mps = mps_pods
    with lock:
        reconcile_at_start(preparer, store, claims, events)
    # With a driver root: prepares wait while specs are brought to a new driver.
    regenerate = functools.partial(node_parts.node_driver_edits, config, devices)
    change = DriverChange.at_start(
        config.driver_root, installed, preparer, regenerate, events=events
    )
    if change is not None and mps_pods is not None:  # MPS daemon pods started later follow
        change.on_edits = mps_pods.follow_driver

    # Built now (no I/O until started) so that prepares served from the gate on can hand it
    # their tenant changes; it writes once started below.
    publisher = node_parts.make_publisher(config, api)

    def republish() -> None:
        publisher.set_devices(devices.slice_devices(), devices.counter_sets())

    # Shared GPUs' tenants from the records reconciled above, before anything is published.
    tenants = TenantAttribute(preparer.load_checkpoint, devices, republish)
    tenants.update()

    health = HealthMonitor(
        backend,
        devices,
        config.node_name,
        on_change=republish,
        healthy_period_s=config.health_recovery_seconds,
        events=events,
    )
    # Prepares are served from here on (the path is complete before the gate opens); what
    # follows only publishes and watches.
    stages = claim_stages(gate, tenants.update, config.node_name, observed, change)
    pipeline.complete(stages, end=preparer)
    log.info("claims pass: %s", " > ".join(pipeline.names))
    gate.open(health)
    if readiness is not None:
        readiness.publisher = publisher
    republish()
    publisher.start()
    health.start()
    status.start()
    agent = PolicyAgent(
        api,
        config.node_name,
        devices=devices,
        preparer=preparer,
        lock=lock,
        republish=republish,
        ignore_xids=health.set_ignored_xids,
        ownership=MigOwnership(config.data_dir / "mig-owned.json"),
    )
    preparer.on_unprepared = agent.claim_unprepared
    agent.start()
    binding = None
    if devices.binding_conditions:
        from flexgpu.kubelet_plugin.agents.binding_watch import BindingWatch
        from flexgpu.kubelet_plugin.claims.early_partitions import EarlyPartitions

        def records() -> Iterable[ClaimRecord]:
            return preparer.load_checkpoint().claims.values()

        binding = BindingWatch(
            api,
            config.node_name,
            early=EarlyPartitions(preparer),
            status=status,
            devices=devices,
            republish=republish,
            failure_s=config.partition_failure_seconds,
            records=records,
            tenants_changed=tenants.update,
            requeue=publisher.publish_again,
            step=preparer.step,
            labels_lease=config.claim_labels_lease,
        )
        tenants.held = binding.tenants.holders
        binding.start()
    if mps_pods is not None:
        mps_pods.watch(
            in_use=lambda: node_parts.mps_gpus(store),
            locked=lambda index: lock.resources({gpu_key(index)}),
        )
    stop_metrics: Callable[[], None] | None = None
    if observed:
        from flexgpu.kubelet_plugin.observe import metrics_setup

        stop_metrics = metrics_setup.observe_node(
            metric_settings,
            node_name=config.node_name,
            backend=backend,
            devices=devices,
            preparer=preparer,
            objects=objects,
            api=api,
            publisher=publisher,
            status_refusals=lambda: status.refused,
            driver_change=change,
        )
    watch = None
    if change is not None:  # after metrics, which count what it settles
        from flexgpu.kubelet_plugin.agents.driver_watch import DriverWatch

        watch = DriverWatch(change)
        watch.start()

    def stop() -> None:
        # Slices stay: the kubelet removes them 30 s after we disconnect, and a restarted
        # plugin takes them over without a window where nothing is published.
        if stop_metrics is not None:
            stop_metrics()
        if mps_pods is not None:
            mps_pods.close()  # the daemon pods stay: their clients keep running
        agent.stop()
        if watch is not None:
            watch.stop()
        if binding is not None:
            binding.stop()
        health.stop()
        publisher.stop()
        status.stop()
        api.close()
        backend.close()

    return stop


def _health_endpoint(config: PluginConfig, readiness: NodeReadiness) -> Callable[[], None]:
    """/livez asks the plugin's own sockets what the kubelet would; /readyz asks readiness."""
    if config.health_port is None:
        return lambda: None
    from flexgpu.kubelet_plugin.kubeletplugin.probe import probe
    from flexgpu.kubelet_plugin.observe.health_endpoint import HealthEndpoint

    def alive() -> str | None:
        if readiness.guard is not None and readiness.guard.waiting:
            return None  # waiting on purpose, with no socket yet: a restart would not help
        return probe(config.registration_socket)

    endpoint = HealthEndpoint(config.health_port, alive=alive, ready=readiness)
    log.info("health probes on :%d (/livez, /readyz)", endpoint.port)
    return endpoint.stop


def _no_device_plugin(config: PluginConfig, readiness: NodeReadiness) -> bool:
    """Waits while a device plugin serves the node (api/device_plugin_guard.py), before
    anything registers with the kubelet; False when a signal ended the wait."""
    if config.device_plugin_guard == "off":
        return True
    from flexgpu.kubelet_plugin.api.device_plugin_guard import DevicePluginGuard
    from flexgpu.kubelet_plugin.api.node_events import NodeEventRecorder

    try:
        api = node_parts.make_api(config)
    except Exception as err:  # start_node reports a bad kubeconfig with its own error
        log.warning("device plugin check skipped: %s", err)
        return True
    guard = DevicePluginGuard(
        api,
        config.node_name,
        NodeEventRecorder(api, config.node_name),
        config.device_plugin_recheck_seconds,
    )
    readiness.guard = guard
    stop_signals = (signal.SIGTERM, signal.SIGINT)
    previous = {s: signal.signal(s, lambda *_: guard.stop()) for s in stop_signals}
    try:
        return guard.wait_until_clear()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(config: PluginConfig) -> int:
    gate = StartupGate()
    # Until start-up completes it, the path of a call is the gate alone, which holds it.
    pipeline = ClaimPipeline([gate])
    server = Server(pipeline, config.server_options(), gate)
    readiness = NodeReadiness(gate)
    stops: list[Callable[[], None]] = [_health_endpoint(config, readiness)]
    if not _no_device_plugin(config, readiness):
        for stop in stops:
            stop()
        return 0

    def after_start() -> None:
        try:
            stops.append(start_node(config, gate, pipeline, readiness))
        except BaseException as err:
            # Waiting prepares get the reason now, not when their wait runs out.
            gate.fail(str(err) or type(err).__name__)
            raise

    try:
        server.run_until_signal((signal.SIGTERM, signal.SIGINT), after_start=after_start)
    except StartupFailed as err:
        log.error("%s", err)
        return 1
    finally:
        for stop in stops:
            stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    limit_malloc_arenas()  # before any thread starts
    try:
        config = load_config(sys.argv[1:] if argv is None else argv)
    except ConfigError as err:
        print(f"flexgpu-kubelet-plugin: {err}", file=sys.stderr)
        return 2
    configure_logging(config.log_level, config.log_format)
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
