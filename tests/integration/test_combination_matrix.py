"""Features crossed, not only tested alone: a pairwise (all-pairs) matrix of what a claim can
meet, run against the real scheduler, the kubelet harness and the plugin.

Dimensions:
- device kind: a whole GPU, an on-demand MIG partition, a static MIG device (made before the
  plugin started), a fraction of a shared GPU;
- opaque config: none, GpuConfig time-slicing, GpuConfig MPS, MigDeviceConfig time-slicing
  (NVIDIA's kind name), MigConfig MPS, a burstable fraction (GpuConfig ``share.computeLimit``
  above the request's compute), a config on ``gpu.nvidia.com`` left over from a migration
  (not flexgpu's: ignored). Time-sliced, MPS and MIG+MPS devices are the kinds with these
  configs;
- tenancy: one namespace, two namespaces at once;
- arrival: one pod, a burst of 16 pods;
- binding conditions: on (the 1.37 default) or off (the plugin's ``--binding-conditions=off``,
  as on 1.35, where the server has none);
- an event in flight: none; the plugin killed between allocation and its binding decision
  (PartitionReady/TenantReady) and started again; the pod and its claim deleted before
  binding; a reallocation after a refusal (a partition whose creation fails once, or a shared
  GPU taken by the other namespace); the NVIDIA driver under the node's driver root upgraded
  in place while the row's prepares run (NVIDIA's GPU Operator reloading its driver);
- the node's taint: none, or ``nvidia.com/gpu:NoSchedule`` as GPU node pools carry it, with
  each pod given what the controller's pod toleration webhook adds (its own function over
  the row's real template and classes; no controller runs here).

allpairspy picks rows (``matrix_rows``) so that every pair of values (of the combinations that
exist) meets in at least one row; the module prints the matrix and its pair coverage.
Combinations that do not exist are excluded by one rule each (``matrix_rows._valid``): a MIG
config on a whole GPU, a GpuConfig on a MIG device or a fraction, a burstable config on
anything but a fraction, a reallocation where nothing can be refused.

The controller's claim labelling runs beside the plugin (bench/node_watchers.py) and the
plugin watches only claims labelled with its node: every row with binding conditions on also
proves that labels reach it in time, across restarts, deletions and reallocations.

Every row: the pods that fit are Running and the rest unschedulable with the scheduler's
reason; each container got one device of the kind asked for, with the sharing its config
asks; every prepared claim's CDI spec names the driver installed now; afterwards no
partition, no claim record and no refused status write is left.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from bench.node_watchers import LEASE_NAME, LEASE_NAMESPACE, LabellingController, lease_marked
from flexgpu.controller.tenant_selector import tenant_expression
from flexgpu.driver.claim_node_label import node_selector
from flexgpu.driver.sim_backend import SimulatedBackend
from tests.conftest import target_minor, wait_for
from tests.integration.gpu_workloads import (
    DRIVER,
    checkpoint_claims,
    ensure_device_classes,
    env_from_log,
    granted,
    make_pod,
    scheduling_report,
)
from tests.integration.matrix_readback import (
    allocated,
    claims_left,
    partitions_made,
    pod_events,
    pods_by_name,
    refused_writes,
    specs_not_on,
)
from tests.integration.matrix_rows import NAMES, Row, coverage, matrix
from tests.integration.matrix_taints import admitted, taint_node
from tests.nvidia_ctk import tools_dir
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.node import driver_root

pytestmark = pytest.mark.integration

NODE = "matrix"
API = f"{DRIVER}/v1alpha1"
# GPUs 0-1 on-demand MIG, 2-3 shared, 4-5 whole; 6-7 start in MIG mode (hgx-h100-8) and get
# seven 1g.10gb instances each before the plugin runs: static MIG devices.
BASE_ARGS = (
    "--dynamic-mig-gpus=0,1",
    "--shared-gpus=2,3",
    "--partition-failure-cooldown=5s",
    f"--claim-labels-lease={LEASE_NAMESPACE}/{LEASE_NAME}",
)
STATIC_GPUS = (6, 7)
SHARED_GPUS = frozenset({"gpu-2", "gpu-3"})
BURST = 16
SHARE = "4Gi"
SETTLE_S = 120
# The words of prepare's refusal of a shared GPU that serves another namespace.
TENANT_REFUSAL = "serves one namespace at a time"
# A burstable fraction's request and limit (percent of SMs): 16 requests fit on one GPU.
BURST_COMPUTE, BURST_LIMIT = "5", 60
# Pods a burst of each kind runs at least (the node's capacity for it).
FITS = {"whole": 2, "mig": 14, "static-mig": 14, "fraction": 16}

UPGRADE = "590.44.01"  # the simulated driver's other version


ROWS = matrix()


def test_the_matrix_covers_every_pair() -> None:
    covered, valid = coverage(ROWS)
    print(f"\ncombination matrix: {len(ROWS)} rows, {covered}/{valid} valid pairs covered")
    for row in ROWS:
        print("  " + " | ".join(f"{n}={getattr(row, n)}" for n in NAMES))
    assert covered == valid


# -- the world ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node(cluster: ControlPlane, api: Any) -> Iterator[SimulatedGpuNode]:
    ensure_device_classes(api)
    labels = LabellingController(cluster.api_client(), identity="matrix-controller")
    labels.start()
    root = Path(tempfile.mkdtemp(prefix="fgmx-", dir="/tmp"))  # specs carry the driver's files
    driver_root.add_mig_capabilities(driver_root.create(root, 8))
    sim = SimulatedGpuNode(
        cluster.kubeconfig,
        NODE,
        "hgx-h100-8",
        plugin_args=(*BASE_ARGS, f"--driver-root={root}"),
        plugin_env={**os.environ, "PATH": f"{tools_dir()}:{os.environ['PATH']}"},
    )
    _partition_static(sim)
    try:
        wait_for(lambda: lease_marked(api), what="the controller's Lease marked: claims labelled")
        sim.start()
        _watching_labelled(sim)
        yield sim
    finally:
        sim.cleanup()
        shutil.rmtree(root, ignore_errors=True)
        labels.stop()


def _watching_labelled(sim: SimulatedGpuNode) -> None:
    selector = f"those labelled {node_selector(NODE)}"
    wait_for(
        lambda: sim.plugin and selector in sim.plugin.log_tail(400),
        what="the plugin watching only its node's labelled claims",
    )


def _partition_static(node: SimulatedGpuNode) -> None:
    node.data_dir.mkdir(parents=True, exist_ok=True)
    backend = SimulatedBackend.from_topology(
        "hgx-h100-8", NODE, state_path=node.data_dir / "simulated-gpus.json"
    )
    for index in STATIC_GPUS:
        (profile,) = [p for p in backend.mig_profiles(index) if p.name == "1g.10gb"]
        for placement in profile.placements:
            backend.create_mig_device(index, profile.profile_id, placement)
    backend.close()


class Plugin:
    """The node's plugin run as a row needs it (binding conditions, injected faults)."""

    def __init__(self, node: SimulatedGpuNode) -> None:
        self.node = node
        self.base = (node.plugin_args, node.plugin_env)
        self.current: tuple[tuple[str, ...], dict[str, str] | None] = self.base
        root = next(a for a in node.plugin_args if a.startswith("--driver-root="))
        self.driver = driver_root.DriverRoot(Path(root.removeprefix("--driver-root=")), 8)

    def ensure(self, row: Row) -> None:
        base_args, env = self.base
        args = base_args + (("--binding-conditions=off",) if row.binding == "off" else ())
        if row.event == "realloc-after-refusal" and row.kind == "mig":
            env = dict(env or os.environ, FLEXGPU_FAULT_FAIL="create_mig_device:1")
        if (args, env) == self.current:
            return
        self.node.stop_plugin()
        self.node.plugin_args, self.node.plugin_env = args, env
        self.node.start_plugin()
        self.current = (args, env)
        if row.binding == "on":
            _watching_labelled(self.node)
        # Claims allocated against the last plugin's slices would carry its binding
        # conditions, which a plugin with them off never decides.
        wanted = row.binding == "on"
        wait_for(
            lambda: self.conditions_published() == wanted,
            timeout_s=60,
            what=f"slices published with binding conditions {row.binding}",
        )

    def conditions_published(self) -> bool:
        """Whether the shared GPU gpu-2 is published with binding conditions (free)."""
        listed = client.ResourceV1Api(self.node.api).list_resource_slice(
            field_selector=f"spec.nodeName={NODE},spec.driver={DRIVER}"
        )
        for item in listed.items:
            for device in item.spec.devices or []:
                if device.name == "gpu-2":
                    return bool(device.binding_conditions)
        return False

    def upgrade_driver(self) -> str:
        """Swaps the driver to its other version, as an in-place upgrade does; returns it."""
        now = driver_root.installed_version(self.driver)
        version = UPGRADE if now == driver_root.DRIVER_VERSION else driver_root.DRIVER_VERSION
        driver_root.install_version(self.driver, version)
        return version

    def kill_and_start(self) -> None:
        self.node.stop_plugin(signal.SIGKILL)
        self.node.start_plugin()


@pytest.fixture(scope="module")
def plugin(node: SimulatedGpuNode) -> Plugin:
    return Plugin(node)


# -- one row --------------------------------------------------------------------------------


def _request(kind: str, namespace: str, config: str) -> dict[str, Any]:
    if kind == "whole":
        # Only whole GPUs 4-5: the on-demand GPUs' partitions and the shared GPUs are other
        # rows' (CEL keeps the row's claims off them).
        exactly: dict[str, Any] = {
            "deviceClassName": "gpu.flexgpu.dev",
            "selectors": [
                {"cel": {"expression": f'device.attributes["{DRIVER}"].index in [4, 5]'}}
            ],
        }
    elif kind in ("mig", "static-mig"):
        parents = "[0, 1]" if kind == "mig" else "[6, 7]"
        exactly = {
            "deviceClassName": "mig.flexgpu.dev",
            "selectors": [
                {
                    "cel": {
                        "expression": f'device.attributes["{DRIVER}"].profile == "1g.10gb" && '
                        f'device.attributes["{DRIVER}"].parentIndex in {parents}'
                    }
                }
            ],
        }
    else:
        wanted = {"memory": SHARE}
        if config == "GpuConfig-burst":
            wanted["compute"] = BURST_COMPUTE
        exactly = {
            "deviceClassName": "shared-gpu.flexgpu.dev",
            "capacity": {"requests": wanted},
            # What the controller's tenancy webhook adds (no controller runs here).
            "selectors": [{"cel": {"expression": tenant_expression(namespace)}}],
        }
    return {"name": "g", "exactly": exactly}


def _config(config: str) -> list[dict[str, Any]]:
    sharing = {
        "GpuConfig-TS": (
            "GpuConfig",
            {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        ),
        "GpuConfig-MPS": ("GpuConfig", {"strategy": "MPS"}),
        "MigDeviceConfig-TS": ("MigDeviceConfig", {"strategy": "TimeSlicing"}),
        "MigConfig-MPS": ("MigConfig", {"strategy": "MPS"}),
    }
    if config == "none":
        return []
    if config == "GpuConfig-burst":
        parameters = {
            "apiVersion": API,
            "kind": "GpuConfig",
            "share": {"computeLimit": BURST_LIMIT},
        }
        return [{"opaque": {"driver": DRIVER, "parameters": parameters}}]
    if config == "nvidia":
        # Left over from NVIDIA's driver: another driver's config, not flexgpu's to apply.
        # Admission refuses it (docs/migrating.md); no webhook runs here, as where an admin
        # turned it off, and the claim is served without it.
        parameters = {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing"},
        }
        return [{"opaque": {"driver": "gpu.nvidia.com", "parameters": parameters}}]
    kind, block = sharing[config]
    return [
        {
            "opaque": {
                "driver": DRIVER,
                "parameters": {"apiVersion": API, "kind": kind, "sharing": block},
            }
        }
    ]


def _template(row: Row, namespace: str) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": [_request(row.kind, namespace, row.config)]}
    if configs := _config(row.config):
        devices["config"] = [{**c, "requests": ["g"]} for c in configs]
    return {"metadata": {"name": "t"}, "spec": {"spec": {"devices": devices}}}


def _check_container(node: SimulatedGpuNode, namespace: str, pod: str, row: Row) -> None:
    env = env_from_log(node.container_log(namespace, pod, "main"))
    got = granted(env)
    assert len(got) == 1, (row.id, pod, got)
    device = got[0]["device"]
    if row.kind == "whole":
        assert device in ("gpu-4", "gpu-5"), (row.id, device)
    elif row.kind == "mig":
        assert device.startswith(("gpu-0-mig-1g10gb-", "gpu-1-mig-1g10gb-")), (row.id, device)
    elif row.kind == "static-mig":
        assert device.startswith(("gpu-6-mig-", "gpu-7-mig-")), (row.id, device)
    else:
        assert device in ("gpu-2", "gpu-3") and got[0].get("share"), (row.id, got)
    if row.config == "GpuConfig-TS":
        assert got[0].get("timeSlice") == "Long", (row.id, got)
    if row.config in ("GpuConfig-MPS", "MigConfig-MPS") or row.kind == "fraction":
        assert "CUDA_MPS_PIPE_DIRECTORY" in env, (row.id, sorted(env))
    if row.config == "GpuConfig-burst":
        # The limit, not the request (whose proportion of memory would give 6).
        assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == str(BURST_LIMIT), (row.id, env)
    if row.config in ("none", "nvidia", "MigDeviceConfig-TS") and row.kind != "fraction":
        assert "CUDA_MPS_PIPE_DIRECTORY" not in env, (row.id, sorted(env))


def expected_running(api: Any, row: Row, outcome: dict[tuple[str, str], str]) -> int | None:
    """How many of the row's pods must run once it has settled, from each pod's state; None
    while the row cannot have settled yet.

    One namespace: what the node has room for, less pods the tenant check refused. Two
    namespaces asking fractions: a shared GPU serves one namespace at a time, and with
    binding conditions off nothing decides a GPU's tenant before binding, so a burst can
    leave one namespace on both shared GPUs (one claim on the second GPU is enough) and the
    other with none: its pods are then rightly refused or unschedulable. What must run is
    every pod not refused of each namespace that holds a GPU; a namespace with nothing
    running has settled once its pods are refused (they stay so) or when every shared GPU
    serves another namespace (an unschedulable pod may otherwise still get a free one)."""
    states = list(outcome.values())
    if row.tenancy != "two" or row.kind != "fraction":
        return min(FITS[row.kind], len(states)) - states.count("Refused")
    held = running_devices(api, outcome)
    wanted = 0
    for ns in {ns for ns, _ in outcome}:
        mine = [state for (n, _), state in outcome.items() if n == ns]
        if held.get(ns):
            wanted += len(mine) - mine.count("Refused")
        elif "Unschedulable" in mine and SHARED_GPUS - {
            d for n, devices in held.items() if n != ns for d in devices
        }:
            return None  # a shared GPU serves no namespace yet: this one may still get it
    return min(FITS[row.kind], wanted)


def running_devices(api: Any, outcome: dict[tuple[str, str], str]) -> dict[str, set[str]]:
    """Namespace -> the devices allocated to the claims of its running pods."""
    held: dict[str, set[str]] = {}
    for ns in {ns for ns, _ in outcome}:
        running = {name for (n, name), state in outcome.items() if n == ns and state == "Running"}
        for claim in client.ResourceV1Api(api).list_namespaced_resource_claim(ns).items:
            owners = {ref.name for ref in claim.metadata.owner_references or []}
            if owners & running and claim.status and claim.status.allocation:
                results = claim.status.allocation.devices.results or []
                held.setdefault(ns, set()).update(r.device for r in results)
    return held


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row(api: Any, node: SimulatedGpuNode, plugin: Plugin, row: Row) -> None:
    if row.binding == "on" and target_minor() < 36:
        pytest.skip("binding conditions need Kubernetes 1.36+")
    plugin.ensure(row)
    taint_node(api, NODE, row.taint == "gpu")
    refused_before = refused_writes(node)
    core = client.CoreV1Api(api)
    resources = client.ResourceV1Api(api)
    namespaces = [f"m-{uuid.uuid4().hex[:6]}-{i}" for i in range(2 if row.tenancy == "two" else 1)]
    per_namespace = (BURST if row.arrival == "burst" else 1 * len(namespaces)) // len(namespaces)
    try:
        for ns in namespaces:
            core.create_namespace({"metadata": {"name": ns}})
            resources.create_namespaced_resource_claim_template(ns, _template(row, ns))
        for i, ns in itertools.product(range(per_namespace), namespaces):
            pod = make_pod(
                f"p{i}",
                "env; echo DONE; sleep 600",
                {"g": {"resourceClaimTemplateName": "t"}},
                node=NODE,
            )
            core.create_namespaced_pod(ns, admitted(api, ns, pod, row.taint == "gpu"))
        deleted: set[tuple[str, str]] = set()
        if row.event == "restart":
            plugin.kill_and_start()
        elif row.event == "driver-upgrade":  # while the row's prepares run
            plugin.upgrade_driver()
        elif row.event == "delete-before-binding":
            wait_for(
                lambda: allocated(api, namespaces[0]),
                timeout_s=SETTLE_S,
                what="a claim allocated",
                explain=lambda: scheduling_report(api, namespaces[0]),
            )
            core.delete_namespaced_pod("p0", namespaces[0], grace_period_seconds=0)
            deleted.add((namespaces[0], "p0"))

        def settled() -> dict[tuple[str, str], str] | None:
            out = {}
            for ns in namespaces:
                reasons = pod_events(api, ns, "FailedScheduling")
                refusals = pod_events(api, ns, "FailedPrepareDynamicResources")
                for name, pod in pods_by_name(api, ns).items():
                    if (ns, name) in deleted:
                        continue
                    if pod.status.phase == "Running":
                        out[(ns, name)] = "Running"
                    elif not pod.spec.node_name and "cannot allocate" in reasons.get(name, ""):
                        out[(ns, name)] = "Unschedulable"
                    elif TENANT_REFUSAL in refusals.get(name, ""):
                        out[(ns, name)] = "Refused"
                    else:
                        return None
            # A pod found unschedulable while the node's slices were written again (a plugin
            # restart, a tenant published) is retried: settled once what fits runs.
            fits = expected_running(api, row, out)
            running = list(out.values()).count("Running")
            return out if fits is not None and running >= fits else None

        # Wrapped: a row whose only pod was deleted settles with no pod left ({}, falsy).
        (outcome,) = wait_for(
            lambda: [o] if (o := settled()) is not None else None,
            timeout_s=SETTLE_S,
            interval_s=0.2,
            what=f"row {row.id} settled",
            explain=lambda: "\n".join(scheduling_report(api, ns) for ns in namespaces),
        )
        running = [key for key, state in outcome.items() if state == "Running"]
        refused = [key for key, state in outcome.items() if state == "Refused"]
        # Prepare refuses a mix of namespaces on one shared GPU only where nothing decided
        # the GPU's tenant before binding: binding conditions off (1.34/1.35), claims of two
        # namespaces allocated in the same instant (docs/security-shared-gpus.md).
        if refused:
            assert (row.kind, row.tenancy, row.binding) == ("fraction", "two", "off"), (
                row.id,
                refused,
            )
        assert len(running) >= (expected_running(api, row, outcome) or 0), (row.id, outcome)
        for ns, name in running:
            _check_container(node, ns, name, row)
        installed = driver_root.installed_version(plugin.driver)  # what every spec names now
        wait_for(
            lambda: not specs_not_on(node, installed),
            timeout_s=30,
            what=f"every prepared claim's CDI spec on driver {installed}",
            explain=lambda: "\n".join(specs_not_on(node, installed)),
        )
        if row.tenancy == "two" and row.kind == "fraction":
            served = {
                ns: {
                    granted(env_from_log(node.container_log(ns, n, "main")))[0]["device"]
                    for m, n in running
                    if m == ns
                }
                for ns in namespaces
            }
            assert not (served[namespaces[0]] & served[namespaces[1]]), served
    finally:
        for ns in namespaces:
            core.delete_namespace(ns, grace_period_seconds=0)
        wait_for(
            lambda: not any(r["namespace"] in namespaces for r in checkpoint_claims(node).values()),
            timeout_s=SETTLE_S,
            what="the row's claim records removed",
        )
        # The next row starts on a cluster whose scheduler no longer counts this row's
        # allocations: a claim still allocated in the API holds its device there.
        wait_for(
            lambda: not claims_left(api, namespaces),
            timeout_s=SETTLE_S,
            what="the row's ResourceClaims gone from the API",
            explain=lambda: repr(claims_left(api, namespaces)),
        )
    wait_for(lambda: not partitions_made(node), timeout_s=60, what="no partition left")
    assert refused_writes(node) == refused_before, row.id
