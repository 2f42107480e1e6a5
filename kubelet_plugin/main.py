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
from typing import TYPE_CHECKING, Any

from flexgpu.driver.log_format import configure_logging
from flexgpu.kubelet_plugin.claims.pipeline import ClaimPipeline, Stage
from flexgpu.kubelet_plugin.claims.startup_gate import StartupGate
from flexgpu.kubelet_plugin.config import ConfigError, PluginConfig
from flexgpu.kubelet_plugin.config_flags import load_config
from flexgpu.kubelet_plugin.kubeletplugin import Server
from flexgpu.kubelet_plugin.malloc_arenas import limit_malloc_arenas

if TYPE_CHECKING:
    from flexgpu.driver.backend import GpuBackend
    from flexgpu.kubelet_plugin.agents.mps_pods import MpsDaemonPods
    from flexgpu.kubelet_plugin.api.device_plugin_guard import DevicePluginGuard
    from flexgpu.kubelet_plugin.api.kube_api import KubeApi
    from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
    from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimRecord
    from flexgpu.kubelet_plugin.claims.driver_change import DriverChange
    from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
    from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher

log = logging.getLogger("flexgpu.kubelet_plugin")


class StartupFailed(RuntimeError):
    """The plugin cannot serve this node (no GPUs, no credentials)."""


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
        backend = make_backend(config)
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
        api = make_api(config)
    except KubeConfigError as err:
        backend.close()
        raise StartupFailed(str(err)) from None
    events = NodeEventRecorder(api, config.node_name)
    count = len(backend.list_gpus())
    devices = NodeDevices(
        backend,
        config.shared_gpu_indices(count),
        config.dynamic_mig_gpu_indices(count),
        health_taints=health_taints(config, api),
        binding_conditions=binding_conditions(config, api),
        publish_tenants=config.shared_gpu_tenants == "namespace",
    )
    # Read before the edits are generated: a change in between is seen, never missed.
    installed = None if config.driver_root is None else read_fingerprint(config.driver_root)
    try:
        driver_edits = _driver_edits(config, devices)
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
    mps_pods = _mps_pods(config, api, backend, driver_edits, events)
    if mps_pods is not None:
        preparer.mps = mps_pods
    with lock:
        reconcile_at_start(preparer, store, claims, events)
    # With a driver root: prepares wait while specs are brought to a new driver.
    regenerate = functools.partial(_driver_edits, config, devices)
    change = DriverChange.at_start(
        config.driver_root, installed, preparer, regenerate, events=events
    )
    if change is not None and mps_pods is not None:  # MPS daemon pods started later follow
        change.on_edits = mps_pods.follow_driver

    # Built now (no I/O until started) so that prepares served from the gate on can hand it
    # their tenant changes; it writes once started below.
    publisher = _make_publisher(config, api)

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
            in_use=lambda: _mps_gpus(store),
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


def _mps_pods(
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


def _mps_gpus(store: CheckpointStore) -> set[int]:
    """GPUs whose MPS daemon a prepared share uses."""
    return {
        r.created.mps_share.gpu_index
        for r in store.checkpoint().claims.values()
        if r.created.mps_share is not None and r.created.mps_share.gpu_index is not None
    }


def _driver_edits(config: PluginConfig, devices: NodeDevices) -> dict[str, Any]:
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


def _make_publisher(config: PluginConfig, api: KubeApi) -> SlicePublisher:
    from flexgpu.kubelet_plugin.devices.slice_publisher import SlicePublisher

    return SlicePublisher(api, config.node_name)


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
        api = make_api(config)
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
