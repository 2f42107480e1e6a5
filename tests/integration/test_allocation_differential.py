"""Differential test: ``driver.allocation`` and the real kube-scheduler agree on every scenario.

Each scenario gets its own driver name, DeviceClass and fresh simulated nodes, so scenarios run
side by side without seeing each other's devices. Pre-existing claims are allocated by the real
scheduler first (pods that use them); then the claim under test is judged by our evaluator from
what the API server holds, and by the scheduler through a pod: bound means allocatable,
``Unschedulable`` means not allocatable, ``SchedulerError`` means the scheduler refuses to schedule
the pod at all (a selector that fails at runtime, for instance).
"""

from __future__ import annotations

import json
import random
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest
from kubernetes import client

from flexgpu.driver.allocation import (
    allocate_anywhere,
    allocated_state,
    parse_claim,
    parse_device_class,
    parse_node,
    parse_slice,
)
from tools.cluster import create_simulated_node

pytestmark = pytest.mark.integration

SEED = 20260917
SCENARIOS = 100
PARALLEL = 8
ADMIN_LABEL = "resource.kubernetes.io/admin-access"
SCENARIO_LABEL = "diff.flexgpu.dev/scenario"
MODELS = ("a100", "h100", "l4")
VERSIONS = ("1.2.3", "1.10.0", "2.0.0", "2.0.0-rc.1")
MEMORIES = ("16Gi", "24Gi", "40Gi", "80Gi")


@dataclass
class Scenario:
    index: int
    kind: str
    run: str
    nodes: list[str] = field(default_factory=list)
    slices: list[dict[str, Any]] = field(default_factory=list)
    pre_claims: list[dict[str, Any]] = field(default_factory=list)
    claim: dict[str, Any] = field(default_factory=dict)

    @property
    def driver(self) -> str:
        return f"s{self.index}-{self.run}.diff.example.com"

    @property
    def label(self) -> str:
        return f"s{self.index}-{self.run}"


# --- scenario generation ------------------------------------------------------------------------


def _device(rng: random.Random, name: str, *, numa: bool = True) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        "model": {"string": rng.choice(MODELS)},
        "drv": {"version": rng.choice(VERSIONS)},
        "healthy": {"bool": rng.random() < 0.8},
    }
    if numa:
        attributes["numa"] = {"int": rng.randrange(2)}
    return {
        "name": name,
        "attributes": attributes,
        "capacity": {"memory": {"value": rng.choice(MEMORIES)}},
    }


def _request(
    name: str, cls: str, count: int = 1, selectors: tuple[str, ...] = (), **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": cls, "count": count, **extra}
    if selectors:
        body["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    if extra.get("allocationMode") == "All":
        body.pop("count")
    return {"name": name, "exactly": body}


def _claim(name: str, requests: list[dict[str, Any]], constraints: Any = None) -> dict[str, Any]:
    devices: dict[str, Any] = {"requests": requests}
    if constraints:
        devices["constraints"] = constraints
    return {"metadata": {"name": name}, "spec": {"devices": devices}}


def _pool_slices(
    sc: Scenario,
    node: str,
    devices: list[dict[str, Any]],
    counters: list[dict[str, Any]] | None = None,
    split: bool = False,
) -> None:
    groups = [devices[: len(devices) // 2], devices[len(devices) // 2 :]] if split else [devices]
    groups = [g for g in groups if g] or [[]]
    count = len(groups) + (1 if counters else 0)
    pool = {"name": node, "generation": 1, "resourceSliceCount": count}
    if counters:
        sc.slices.append({"nodeName": node, "pool": pool, "sharedCounters": counters})
    for group in groups:
        sc.slices.append({"nodeName": node, "pool": pool, "devices": group})


def _selector(rng: random.Random, d: str) -> str:
    attrs, capacity = f'device.attributes["{d}"]', f'device.capacity["{d}"]'
    return rng.choice(
        [
            f'{attrs}.model == "{rng.choice(MODELS)}"',
            f"{attrs}.numa == {rng.randrange(2)}",
            f'{attrs}.drv.isGreaterThan(semver("{rng.choice(VERSIONS)}"))',
            f'{attrs}.drv.compareTo(semver("2.0.0")) >= 0 && {attrs}.healthy',
            f'{capacity}.memory.compareTo(quantity("{rng.choice(MEMORIES)}")) >= 0',
            f'{capacity}.memory.isLessThan(quantity("40Gi"))',
            f'{attrs}.model.startsWith("a") || {attrs}.model.endsWith("4")',
            f"{attrs}.drv.major() >= 2",
        ]
    )


def _basic_nodes(rng: random.Random, sc: Scenario, per_node: tuple[int, int], **kw: Any) -> None:
    for n in sc.nodes:
        devices = [_device(rng, f"dev-{i}", **kw) for i in range(rng.randint(*per_node))]
        _pool_slices(sc, n, devices, split=rng.random() < 0.3)


def _pre(sc: Scenario, rng: random.Random, count_max: int, cls: str, **extra: Any) -> None:
    for j in range(rng.randint(0, count_max)):
        sc.pre_claims.append(
            _claim(f"s{sc.index}-pre{j}", [_request("r", cls, rng.randint(1, 2), **extra)])
        )


def gen_counts(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (1, 4))
    _pre(sc, rng, 3, cls)
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 5))])


def gen_selectors(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (2, 5))
    _pre(sc, rng, 1, cls)
    sels = tuple(_selector(rng, sc.driver) for _ in range(rng.randint(1, 2)))
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 3), sels)])


def gen_missing_attribute(rng: random.Random, sc: Scenario, cls: str) -> None:
    # Some devices lack "numa": a selector reading it fails at runtime on them, unless guarded.
    for n in sc.nodes:
        devices = [_device(rng, f"dev-{i}", numa=rng.random() < 0.5) for i in range(3)]
        _pool_slices(sc, n, devices)
    attr = f'device.attributes["{sc.driver}"]'
    expression = rng.choice(
        [
            f"{attr}.numa == 1",
            f'{attr}.numa >= 0 && {attr}.model != ""',
            f'"numa" in {attr} && {attr}.numa == 1',
            f"has({attr}.numa)",
        ]
    )
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 2), (expression,))])


def gen_match(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (2, 5))
    _pre(sc, rng, 2, cls)
    kind = rng.choice(["matchAttribute", "distinctAttribute"])
    attr = rng.choice(["numa", "model", "drv"])
    requests = [_request("a", cls, rng.randint(1, 2))]
    if rng.random() < 0.5:
        requests.append(_request("b", cls, 1))
    constraint = {kind: f"{sc.driver}/{attr}"}
    if len(requests) > 1 and rng.random() < 0.5:
        constraint["requests"] = ["a", "b"]
    sc.claim = _claim("claim", requests, [constraint])


def gen_all(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (1, 4))
    _pre(sc, rng, 1, cls)
    selectors = (_selector(rng, sc.driver),) if rng.random() < 0.5 else ()
    constraints = [{"matchAttribute": f"{sc.driver}/numa"}] if rng.random() < 0.3 else None
    sc.claim = _claim(
        "claim", [_request("r", cls, 1, selectors, allocationMode="All")], constraints
    )


def gen_first_available(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (1, 4))
    _pre(sc, rng, 2, cls)
    subs = []
    for k in range(rng.randint(2, 3)):
        sub: dict[str, Any] = {
            "name": f"alt{k}",
            "deviceClassName": cls,
            "count": rng.randint(1, 3),
        }
        if rng.random() < 0.6:
            sub["selectors"] = [{"cel": {"expression": _selector(rng, sc.driver)}}]
        subs.append(sub)
    requests = [{"name": "r", "firstAvailable": subs}]
    constraints = None
    if rng.random() < 0.4:
        requests.append(_request("x", cls, 1))
        constraints = [{"distinctAttribute": f"{sc.driver}/numa"}]
    sc.claim = _claim("claim", requests, constraints)


def gen_taints(rng: random.Random, sc: Scenario, cls: str) -> None:
    for n in sc.nodes:
        devices = []
        for i in range(rng.randint(1, 4)):
            dev = _device(rng, f"dev-{i}")
            if rng.random() < 0.6:
                dev["taints"] = [
                    {
                        "key": rng.choice(["flexgpu.dev/maintenance", "flexgpu.dev/degraded"]),
                        "value": rng.choice(["yes", "no"]),
                        "effect": "NoSchedule",
                    }
                ]
            devices.append(dev)
        _pool_slices(sc, n, devices)
    tolerations = rng.choice(
        [
            [],
            [{"key": "flexgpu.dev/maintenance", "operator": "Exists"}],
            [{"key": "flexgpu.dev/degraded", "value": "yes", "effect": "NoSchedule"}],
            [{"operator": "Exists", "effect": "NoExecute"}],
        ]
    )
    extra = {"tolerations": tolerations} if tolerations else {}
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 3), **extra)])


def gen_counters(rng: random.Random, sc: Scenario, cls: str) -> None:
    # Partitionable GPUs: every partition draws on its parent's memory counter.
    sizes = {"full": 80, "half": 40, "quarter": 20}
    for n in sc.nodes:
        counters, devices = [], []
        for g in range(rng.randint(1, 2)):
            counters.append({"name": f"gpu-{g}", "counters": {"mem": {"value": "80Gi"}}})
            for part, gi in sizes.items():
                for k in range(80 // gi if rng.random() < 0.7 else 1):
                    dev = _device(rng, f"gpu-{g}-{part}-{k}")
                    dev["attributes"]["part"] = {"string": part}
                    dev["capacity"]["memory"] = {"value": f"{gi}Gi"}
                    dev["consumesCounters"] = [
                        {"counterSet": f"gpu-{g}", "counters": {"mem": {"value": f"{gi}Gi"}}}
                    ]
                    devices.append(dev)
        _pool_slices(sc, n, devices, counters, split=rng.random() < 0.3)
    attr = f'device.attributes["{sc.driver}"]'
    for j in range(rng.randint(0, 3)):
        part = rng.choice(list(sizes))
        sel = (f'{attr}.part == "{part}"',)
        sc.pre_claims.append(_claim(f"s{sc.index}-pre{j}", [_request("r", cls, 1, sel)]))
    part = rng.choice(list(sizes))
    admin = {"adminAccess": True} if rng.random() < 0.2 else {}
    sc.claim = _claim(
        "claim", [_request("r", cls, rng.randint(1, 3), (f'{attr}.part == "{part}"',), **admin)]
    )


def gen_consumable(rng: random.Random, sc: Scenario, cls: str) -> None:
    policies = [
        {"default": "8Gi", "validRange": {"min": "4Gi", "step": "4Gi"}},
        {"validValues": ["10Gi", "20Gi", "40Gi"], "default": "10Gi"},
        {"default": "16Gi", "validRange": {"min": "8Gi", "max": "32Gi"}},
        None,
    ]
    for n in sc.nodes:
        devices = []
        for i in range(rng.randint(1, 2)):
            dev = _device(rng, f"shared-{i}")
            dev["allowMultipleAllocations"] = True
            memory: dict[str, Any] = {"value": "40Gi"}
            policy = rng.choice(policies)
            if policy is not None:
                memory["requestPolicy"] = policy
            dev["capacity"] = {"memory": memory, "compute": {"value": "100"}}
            devices.append(dev)
        if rng.random() < 0.4:
            devices.append(_device(rng, "exclusive-0"))
        _pool_slices(sc, n, devices)

    def capacity() -> dict[str, Any]:
        requests: dict[str, str] = {"compute": str(rng.choice([10, 30, 50]))}
        if rng.random() < 0.8:
            requests["memory"] = rng.choice(["3Gi", "9Gi", "12Gi", "20Gi", "33Gi"])
        return {"capacity": {"requests": requests}}

    for j in range(rng.randint(0, 3)):
        sc.pre_claims.append(_claim(f"s{sc.index}-pre{j}", [_request("r", cls, 1, **capacity())]))
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 2), **capacity())])


def gen_admin(rng: random.Random, sc: Scenario, cls: str) -> None:
    _basic_nodes(rng, sc, (1, 3))
    _pre(sc, rng, 3, cls)
    sc.claim = _claim("claim", [_request("r", cls, rng.randint(1, 3), adminAccess=True)])


GENERATORS: dict[str, Callable[[random.Random, Scenario, str], None]] = {
    "counts": gen_counts,
    "selectors": gen_selectors,
    "missing-attribute": gen_missing_attribute,
    "constraints": gen_match,
    "all": gen_all,
    "first-available": gen_first_available,
    "taints": gen_taints,
    "counters": gen_counters,
    "consumable": gen_consumable,
    "admin": gen_admin,
}


def make_scenario(rng: random.Random, index: int, run: str) -> Scenario:
    kind = list(GENERATORS)[index % len(GENERATORS)]
    sc = Scenario(index, kind, run)
    sc.nodes = [f"diff-{run}-s{index}-n{k}" for k in range(rng.randint(1, 2))]
    GENERATORS[kind](rng, sc, sc.driver)
    return sc


# --- running a scenario ---------------------------------------------------------------------------


def _raw(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The object as the server sent it: the client's models may lag the API's fields."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


def _pod(name: str, claim: str, label: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeSelector": {SCENARIO_LABEL: label},
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {"name": "c", "image": "none", "resources": {"claims": [{"name": "g"}]}}
            ],
            "resourceClaims": [{"name": "g", "resourceClaimName": claim}],
        },
    }


def _scheduler_outcome(
    core: Any, namespace: str, pod: str, timeout_s: float = 45
) -> tuple[str, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = _raw(core.read_namespaced_pod, pod, namespace)
        if body["spec"].get("nodeName"):
            return "allocatable", body["spec"]["nodeName"]
        for cond in body.get("status", {}).get("conditions", []) or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
                reason, message = cond.get("reason", ""), cond.get("message", "")
                if reason == "Unschedulable":
                    return "unallocatable", message
                if reason == "SchedulerError":
                    return "error", message
        time.sleep(0.2)
    return "timeout", ""


@dataclass
class Outcome:
    scenario: Scenario
    ours: str = ""
    ours_reason: str = ""
    scheduler: str = ""
    scheduler_message: str = ""
    # When both say allocatable: the devices each picked on the node the scheduler chose.
    our_devices: list[str] = field(default_factory=list)
    scheduler_devices: list[str] = field(default_factory=list)


def run_scenario(api: Any, namespace: str, sc: Scenario) -> Outcome:
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)
    out = Outcome(sc)
    for n in sc.nodes:
        create_simulated_node(api, n, labels={SCENARIO_LABEL: sc.label})
    resource.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": sc.driver},
            "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{sc.driver}"'}}]},
        }
    )
    for k, spec in enumerate(sc.slices):
        resource.create_resource_slice(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"{sc.label}-{k}"},
                "spec": {"driver": sc.driver, **spec},
            }
        )
    # Pre-existing claims: allocated by the scheduler through pods, one after the other so the
    # state is the scheduler's own first-fit result.
    for j, pre in enumerate(sc.pre_claims):
        resource.create_namespaced_resource_claim(namespace, pre)
        core.create_namespaced_pod(
            namespace, _pod(f"{sc.label}-pre{j}", pre["metadata"]["name"], sc.label)
        )
        _scheduler_outcome(core, namespace, f"{sc.label}-pre{j}")

    claim = json.loads(json.dumps(sc.claim))
    claim["metadata"]["name"] = f"{sc.label}-claim"
    resource.create_namespaced_resource_claim(namespace, claim)

    slices = [
        parse_slice(s)
        for s in _raw(resource.list_resource_slice, field_selector=f"spec.driver={sc.driver}")[
            "items"
        ]
    ]
    classes = {sc.driver: parse_device_class(_raw(resource.read_device_class, sc.driver))}
    claims = [
        parse_claim(c) for c in _raw(resource.list_namespaced_resource_claim, namespace)["items"]
    ]
    target = next(c for c in claims if c.name == claim["metadata"]["name"])
    nodes = [parse_node(_raw(core.read_node, n)) for n in sc.nodes]
    verdict = allocate_anywhere([target], nodes, slices, classes, allocated_state(claims))
    out.ours = verdict.outcome
    out.ours_reason = "; ".join(f"{v.node}: {v.outcome} {v.reason}" for v in verdict.per_node)

    core.create_namespaced_pod(
        namespace, _pod(f"{sc.label}-test", claim["metadata"]["name"], sc.label)
    )
    out.scheduler, out.scheduler_message = _scheduler_outcome(core, namespace, f"{sc.label}-test")
    if out.scheduler == out.ours == "allocatable":
        # First fit is deterministic per node, so the device picks must be the same too.
        chosen = next(v for v in verdict.per_node if v.node == out.scheduler_message)
        out.our_devices = [f"{d.request}:{d.device}" for d in chosen.devices[0]]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not out.scheduler_devices:
            body = _raw(
                resource.read_namespaced_resource_claim, claim["metadata"]["name"], namespace
            )
            allocation = (body.get("status") or {}).get("allocation") or {}
            results = allocation.get("devices", {}).get("results", [])
            out.scheduler_devices = [f"{r['request']}:{r['device']}" for r in results]
            time.sleep(0.2)
    return out


def cleanup(api: Any, namespace: str, sc: Scenario) -> None:
    core, resource = client.CoreV1Api(api), client.ResourceV1Api(api)

    def quietly(call: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        try:
            call(*args, **kwargs)
        except client.ApiException as err:
            if err.status != 404:
                raise

    for name in [f"{sc.label}-pre{j}" for j in range(len(sc.pre_claims))] + [f"{sc.label}-test"]:
        quietly(core.delete_namespaced_pod, name, namespace, grace_period_seconds=0)
    for k in range(len(sc.slices)):
        quietly(resource.delete_resource_slice, f"{sc.label}-{k}")
    quietly(resource.delete_device_class, sc.driver)
    for n in sc.nodes:
        quietly(core.delete_node, n)


@pytest.fixture
def admin_namespace(api: Any, namespace: str) -> Iterator[str]:
    client.CoreV1Api(api).patch_namespace(
        namespace, {"metadata": {"labels": {ADMIN_LABEL: "true"}}}
    )
    yield namespace


@pytest.mark.requires_k8s(
    "1.36",
    why="the evaluator follows the 1.36+ allocator: the 1.34.12 scheduler's alpha allocator "
    "panics on a matchAttribute scenario (index out of range in CmpRequestOverCapacity) and "
    "stops scheduling for the rest of the run; the 1.35.8 one disagrees on a matchAttribute "
    "scenario",
)
def test_evaluator_agrees_with_the_scheduler(api: Any, admin_namespace: str) -> None:
    rng = random.Random(SEED)
    run = uuid.uuid4().hex[:5]
    scenarios = [make_scenario(rng, i, run) for i in range(SCENARIOS)]
    started = time.monotonic()
    outcomes: list[Outcome] = []
    try:
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            outcomes = list(pool.map(lambda sc: run_scenario(api, admin_namespace, sc), scenarios))
    finally:
        with ThreadPoolExecutor(max_workers=PARALLEL) as pool:
            list(pool.map(lambda sc: cleanup(api, admin_namespace, sc), scenarios))
    elapsed = time.monotonic() - started
    tally: dict[str, int] = {}
    for o in outcomes:
        tally[f"{o.scenario.kind}:{o.scheduler}"] = (
            tally.get(f"{o.scenario.kind}:{o.scheduler}", 0) + 1
        )
    print(f"\n{len(outcomes)} differential scenarios in {elapsed:.0f}s: {sorted(tally.items())}")
    disagreements = [
        f"scenario {o.scenario.index} ({o.scenario.kind}): ours={o.ours} [{o.ours_reason}] "
        f"scheduler={o.scheduler} [{o.scheduler_message}]\n  claim={json.dumps(o.scenario.claim)}"
        for o in outcomes
        if o.ours != o.scheduler
    ]
    disagreements += [
        f"scenario {o.scenario.index} ({o.scenario.kind}): we pick {o.our_devices}, "
        f"the scheduler picked {o.scheduler_devices} on {o.scheduler_message}"
        for o in outcomes
        if o.our_devices != o.scheduler_devices
    ]
    assert not disagreements, "\n".join(disagreements)
    # The generated mix must exercise all three verdicts, or the comparison proves little.
    assert {o.scheduler for o in outcomes} >= {"allocatable", "unallocatable"}
