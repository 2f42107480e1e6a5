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
  GPU taken by the other namespace);
- the node's taint: none, or ``nvidia.com/gpu:NoSchedule`` as GPU node pools carry it, with
  each pod given what the controller's pod toleration webhook adds (its own function over
  the row's real template and classes; no controller runs here).

allpairspy picks rows so that every pair of values (of the combinations that exist) meets in
at least one row; the module prints the matrix and its pair coverage. Combinations that do
not exist are excluded by one rule each (``_valid``): a MIG config on a whole GPU, a GpuConfig
on a MIG device or a fraction, a burstable config on anything but a fraction, a reallocation
where nothing can be refused.

The controller's claim labelling runs beside the plugin (bench/node_watchers.py) and the
plugin watches only claims labelled with its node: every row with binding conditions on also
proves that labels reach it in time, across restarts, deletions and reallocations.

Every row: the pods that fit are Running and the rest unschedulable with the scheduler's
reason; each container got one device of the kind asked for, with the sharing its config
asks; afterwards no partition, no claim record and no refused status write is left.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import signal
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from allpairspy import AllPairs
from kubernetes import client

from bench.node_watchers import LEASE_NAME, LEASE_NAMESPACE, LabellingController, lease_marked
from flexgpu.controller.gpu_tolerations import DEFAULT_GPU_TOLERATIONS, answer_toleration_review
from flexgpu.controller.pod_claim_lookup import ApiClaimLookup
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
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode
from tools.cluster.nodes import mark_node_ready

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
BURST = 16
SHARE = "4Gi"
SETTLE_S = 120
# The words of prepare's refusal of a shared GPU that serves another namespace.
TENANT_REFUSAL = "serves one namespace at a time"
# A burstable fraction's request and limit (percent of SMs): 16 requests fit on one GPU.
BURST_COMPUTE, BURST_LIMIT = "5", 60
# Pods a burst of each kind runs at least (the node's capacity for it).
FITS = {"whole": 2, "mig": 14, "static-mig": 14, "fraction": 16}

KINDS = ("whole", "mig", "static-mig", "fraction")
CONFIGS = (
    "none",
    "GpuConfig-TS",
    "GpuConfig-MPS",
    "MigDeviceConfig-TS",
    "MigConfig-MPS",
    "GpuConfig-burst",
    "nvidia",
)
TENANCY = ("one", "two")
ARRIVAL = ("one", "burst")
BINDING = ("on", "off")
EVENTS = ("none", "restart", "delete-before-binding", "realloc-after-refusal")
TAINTS = ("none", "gpu")
DIMENSIONS = (KINDS, CONFIGS, TENANCY, ARRIVAL, BINDING, EVENTS, TAINTS)
NAMES = ("kind", "config", "tenancy", "arrival", "binding", "event", "taint")
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@dataclass(frozen=True)
class Row:
    kind: str
    config: str
    tenancy: str
    arrival: str
    binding: str
    event: str
    taint: str

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(getattr(self, n) for n in NAMES)

    @property
    def id(self) -> str:
        return "-".join(self.values)


def _valid(values: list[str]) -> bool:
    """Whether a (partial) row names a combination that exists."""
    row = dict(zip(NAMES, values, strict=False))
    kind, config, event = row.get("kind"), row.get("config"), row.get("event")
    if kind == "whole" and config in ("MigDeviceConfig-TS", "MigConfig-MPS"):
        return False  # a MIG config on a whole GPU: refused (tested in test_opaque_config)
    if kind in ("mig", "static-mig", "fraction") and config in ("GpuConfig-TS", "GpuConfig-MPS"):
        return False  # a GpuConfig on a MIG device or a fraction: refused likewise
    if kind == "fraction" and config in ("MigDeviceConfig-TS", "MigConfig-MPS"):
        return False
    if config == "GpuConfig-burst" and kind not in (None, "fraction"):
        return False  # the share block on a whole GPU: refused (tested in test_share_config)
    if event == "realloc-after-refusal":
        # Something must be refusable: a partition made before binding (on-demand MIG with
        # binding conditions), or a free shared GPU another namespace takes (two tenants).
        if kind not in (None, "mig", "fraction"):
            return False
        if row.get("binding") == "off":
            return False
        if kind == "fraction" and row.get("tenancy") == "one":
            return False
    return True


def _pairs(values: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(values), 2)}


def _valid_rows() -> list[tuple[str, ...]]:
    return [v for v in itertools.product(*DIMENSIONS) if _valid(list(v))]


def valid_pairs() -> set[tuple[int, str, int, str]]:
    """Every pair of values some valid row holds."""
    return set().union(*(_pairs(v) for v in _valid_rows()))


def matrix() -> list[Row]:
    """allpairspy's rows, completed: with a filter it may leave a pair out, so each pair
    still missing gets the valid row that covers it and the most other missing pairs."""
    rows = [tuple(r) for r in AllPairs(list(DIMENSIONS), filter_func=_valid)]
    missing = valid_pairs() - set().union(*(_pairs(r) for r in rows))
    candidates = _valid_rows()
    while missing:
        pair = min(missing)
        best = max(
            (v for v in candidates if pair in _pairs(v)),
            key=lambda v: (len(_pairs(v) & missing), v),
        )
        rows.append(best)
        missing -= _pairs(best)
    # Rows that need the same plugin run next to each other: fewer restarts.
    return sorted(
        (Row(*r) for r in rows),
        key=lambda r: (r.binding, r.event == "realloc-after-refusal", r.kind, r.id),
    )


def coverage(rows: list[Row]) -> tuple[int, int]:
    """(pairs covered, valid pairs)."""
    valid = valid_pairs()
    covered = set().union(*(_pairs(r.values) for r in rows))
    return len(covered & valid), len(valid)


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
    sim = SimulatedGpuNode(cluster.kubeconfig, NODE, "hgx-h100-8", plugin_args=BASE_ARGS)
    _partition_static(sim)
    try:
        wait_for(lambda: lease_marked(api), what="the controller's Lease marked: claims labelled")
        sim.start()
        _watching_labelled(sim)
        yield sim
    finally:
        sim.cleanup()
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
        self.current: tuple[tuple[str, ...], dict[str, str] | None] = (BASE_ARGS, None)

    def ensure(self, row: Row) -> None:
        args = BASE_ARGS + (("--binding-conditions=off",) if row.binding == "off" else ())
        env = None
        if row.event == "realloc-after-refusal" and row.kind == "mig":
            env = dict(os.environ, FLEXGPU_FAULT_FAIL="create_mig_device:1")
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


def _taint(api: Any, row: Row) -> None:
    """The node tainted as the row says (the taint of other rows removed)."""
    if row.taint == "gpu":
        mark_node_ready(api, NODE, taints=[GPU_TAINT])
        return
    core = client.CoreV1Api(api)
    taints = core.read_node(NODE).spec.taints or []
    kept = [
        {"key": t.key, "value": t.value, "effect": t.effect}
        for t in taints
        if t.key != GPU_TAINT["key"]
    ]
    if len(kept) != len(taints):
        core.patch_node(NODE, {"spec": {"taints": kept or None}})


def _admitted(api: Any, namespace: str, pod: dict[str, Any], row: Row) -> dict[str, Any]:
    """The pod as the pod toleration webhook admits it on a tainted row: its answer to the
    review, over the row's template and classes as the API server has them."""
    if row.taint != "gpu":
        return pod
    review = {
        "request": {
            "uid": "matrix",
            "operation": "CREATE",
            "namespace": namespace,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": pod,
        }
    }
    answer = answer_toleration_review(list(DEFAULT_GPU_TOLERATIONS), ApiClaimLookup(api), review)
    assert answer is not None and "patch" in answer["response"], (row.id, answer)
    (op,) = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert op["path"] == "/spec/tolerations", (row.id, op)
    return {**pod, "spec": {**pod["spec"], "tolerations": op["value"]}}


def _phases(api: Any, namespace: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in client.CoreV1Api(api).list_namespaced_pod(namespace).items}


def _events(api: Any, namespace: str, reason: str) -> dict[str, str]:
    """Pod -> the message of an Event of ``reason`` recorded on it."""
    events = client.CoreV1Api(api).list_namespaced_event(namespace).items
    return {
        e.involved_object.name: e.message or ""
        for e in events
        if e.reason == reason and e.involved_object.kind == "Pod"
    }


def _claims_left(api: Any, namespaces: list[str]) -> list[str]:
    claims = client.ResourceV1Api(api).list_resource_claim_for_all_namespaces().items
    return [
        f"{c.metadata.namespace}/{c.metadata.name}"
        for c in claims
        if c.metadata.namespace in namespaces
    ]


def _allocated(api: Any, namespace: str) -> bool:
    claims = client.ResourceV1Api(api).list_namespaced_resource_claim(namespace).items
    return any(c.status and c.status.allocation for c in claims)


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


def _refused_writes(node: SimulatedGpuNode) -> int:
    """Status writes the API server refused, in every log of the node's plugin so far."""
    return sum(
        path.read_text(errors="replace").count("status: 422")
        for path in (node.root / "logs").glob("plugin-*.log")
    )


def _partitions_made(node: SimulatedGpuNode) -> list[dict[str, Any]]:
    """MIG instances on the on-demand GPUs, as the simulated hardware holds them."""
    state = json.loads((node.data_dir / "simulated-gpus.json").read_text())
    return [i for index in (0, 1) for i in state["gpus"][index]["mig_instances"]]


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_row(api: Any, node: SimulatedGpuNode, plugin: Plugin, row: Row) -> None:
    if row.binding == "on" and target_minor() < 36:
        pytest.skip("binding conditions need Kubernetes 1.36+")
    plugin.ensure(row)
    _taint(api, row)
    refused_before = _refused_writes(node)
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
            core.create_namespaced_pod(ns, _admitted(api, ns, pod, row))
        deleted: set[tuple[str, str]] = set()
        if row.event == "restart":
            plugin.kill_and_start()
        elif row.event == "delete-before-binding":
            wait_for(
                lambda: _allocated(api, namespaces[0]),
                timeout_s=SETTLE_S,
                what="a claim allocated",
                explain=lambda: scheduling_report(api, namespaces[0]),
            )
            core.delete_namespaced_pod("p0", namespaces[0], grace_period_seconds=0)
            deleted.add((namespaces[0], "p0"))

        def settled() -> dict[tuple[str, str], str] | None:
            out = {}
            for ns in namespaces:
                reasons = _events(api, ns, "FailedScheduling")
                refusals = _events(api, ns, "FailedPrepareDynamicResources")
                for name, pod in _phases(api, ns).items():
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
            states = list(out.values())
            fits = min(FITS[row.kind], len(states)) - states.count("Refused")
            return out if states.count("Running") >= fits else None

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
        wanted = min(FITS[row.kind], per_namespace * len(namespaces) - len(deleted)) - len(refused)
        assert len(running) >= wanted, (row.id, outcome)
        for ns, name in running:
            _check_container(node, ns, name, row)
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
            lambda: not _claims_left(api, namespaces),
            timeout_s=SETTLE_S,
            what="the row's ResourceClaims gone from the API",
            explain=lambda: repr(_claims_left(api, namespaces)),
        )
    wait_for(lambda: not _partitions_made(node), timeout_s=60, what="no partition left")
    assert _refused_writes(node) == refused_before, row.id
