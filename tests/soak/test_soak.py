"""Soak: three simulated nodes under pod churn of every claim kind while, at random, a plugin is
SIGKILLed (at any moment, or by itself at a named step of a prepare or unprepare), the
apiserver restarts and a node's slices are deleted. Proves that no two prepared claims ever
hold the same exclusive device, and that once every pod is gone nothing is left: no claim
record, CDI spec, MIG instance, MPS daemon or changed GPU setting, and every node has its
slices. Runs only with FLEXGPU_SOAK_MINUTES set (see docs/development.md, Soak)."""

from __future__ import annotations

import os
import random
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.integration.gpu_workloads import ensure_device_classes
from tests.soak.chaos import Chaos, poll, slices
from tests.soak.churn import Churn, kinds
from tests.soak.invariants import double_allocations, gpu_settings, in_use, leftovers
from tools.cluster import ControlPlane
from tools.cluster.gpu_node import SimulatedGpuNode

MINUTES_ENV = "FLEXGPU_SOAK_MINUTES"
SEED_ENV = "FLEXGPU_SOAK_SEED"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not os.environ.get(MINUTES_ENV),
        reason=f"soak test: runs only with {MINUTES_ENV}=<minutes> (docs/development.md, Soak)",
    ),
]

WHOLE, MIG, SHARED = "soak-whole", "soak-mig", "soak-shared"
DYNAMIC_MIG = {0, 1, 2, 3}
# Seconds between chaos actions, and between new workloads: bounded rates on a small machine.
CHAOS_GAP_S = (10.0, 30.0)
CREATE_GAP_S = (1.0, 3.0)
QUIESCE_S = 300.0


@pytest.fixture(scope="module")
def nodes(cluster: ControlPlane, api: Any) -> Iterator[dict[str, SimulatedGpuNode]]:
    ensure_device_classes(api)
    dynamic = ",".join(str(i) for i in sorted(DYNAMIC_MIG))
    # Node folders (plugin and harness logs, state files) are kept for a look after the run;
    # short paths, since Unix socket paths are capped at 107 bytes.
    keep = Path(tempfile.mkdtemp(prefix="fg-soak-", dir="/tmp"))
    print(f"\nsoak node folders (kept): {keep}")
    sims = {
        WHOLE: SimulatedGpuNode(cluster.kubeconfig, WHOLE, "hgx-h100-8", root=keep / "w"),
        MIG: SimulatedGpuNode(
            cluster.kubeconfig,
            MIG,
            "hgx-h100-8",
            root=keep / "m",
            plugin_args=(f"--dynamic-mig-gpus={dynamic}",),
        ),
        SHARED: SimulatedGpuNode(
            cluster.kubeconfig,
            SHARED,
            "hgx-h100-8",
            root=keep / "s",
            plugin_args=("--shared-gpus=0,1",),
        ),
    }
    try:
        for sim in sims.values():
            sim.start(timeout_s=120)
        yield sims
    finally:
        for sim in sims.values():
            sim.cleanup()


def _warning_events(api: Any, namespace: str, nodes: set[str]) -> Counter[str]:
    """Warning Events by reason: on the soak's pods, and on its Nodes (plugin Events)."""
    core = client.CoreV1Api(api)
    counts: Counter[str] = Counter()
    for e in core.list_namespaced_event(namespace).items:
        if e.type == "Warning":
            counts[f"pod: {e.reason}"] += e.count or 1
    for e in core.list_namespaced_event("default").items:
        if e.type == "Warning" and e.involved_object.name in nodes:
            counts[f"node: {e.reason}"] += e.count or 1
    return counts


def test_soak_no_leaks_and_no_double_allocation(
    cluster: ControlPlane, api: Any, namespace: str, nodes: dict[str, SimulatedGpuNode]
) -> None:
    minutes = float(os.environ[MINUTES_ENV])
    seed = int(os.environ.get(SEED_ENV) or time.time())
    rng = random.Random(seed)
    baseline = {name: gpu_settings(node) for name, node in nodes.items()}
    problems: list[str] = []
    churn = Churn(cluster.api_client(), namespace, kinds(WHOLE, MIG, SHARED), rng)
    chaos = Chaos(cluster, nodes, random.Random(seed + 1), problems)
    stop = threading.Event()
    checks = Counter[str]()

    def churn_loop() -> None:
        next_create = time.monotonic()
        while not stop.is_set():
            create = creating.is_set() and time.monotonic() >= next_create
            if create:
                next_create = time.monotonic() + rng.uniform(*CREATE_GAP_S)
            churn.tick(create)
            stop.wait(1.0)

    def check_loop() -> None:
        while not stop.is_set():
            for node in nodes.values():
                try:
                    found = double_allocations(node)
                except (OSError, ValueError, KeyError) as exc:  # a record that does not parse
                    found = [f"{node.name}: unreadable plugin state: {exc!r}"]
                problems.extend(p for p in found if p not in problems)
                try:
                    prepared, grants = in_use(node)
                except (OSError, ValueError, KeyError):
                    continue
                checks["most prepared claims at once"] = max(
                    checks["most prepared claims at once"], prepared
                )
                checks["most CDI device grants at once"] = max(
                    checks["most CDI device grants at once"], grants
                )
            problems.extend(p for p in chaos.dead_plugins() if p not in problems)
            checks["invariant passes"] += 1
            stop.wait(2.0)

    creating = threading.Event()
    creating.set()
    threads = [threading.Thread(target=f, daemon=True) for f in (churn_loop, check_loop)]
    for t in threads:
        t.start()
    started = time.monotonic()
    try:
        end = started + minutes * 60
        next_act = started + rng.uniform(*CHAOS_GAP_S)
        # Processes are started from this thread only: they die with the thread that started
        # them (PR_SET_PDEATHSIG in tools/cluster/process.py), and this one lives to the end.
        while time.monotonic() < end and not problems:
            stop.wait(1.0)
            try:
                chaos.revive()
                if next_act <= time.monotonic() < end:
                    chaos.act()
                    next_act = time.monotonic() + rng.uniform(*CHAOS_GAP_S)
            except Exception as exc:  # a plugin or apiserver that did not come back
                problems.append(f"chaos action failed: {exc}")
        churned_s = time.monotonic() - started

        # Quiesce: no new workloads, no armed plugin, every pod and claim deleted and gone.
        creating.clear()
        chaos.revive(disarm=True)
        churn.delete_all()
        core = client.CoreV1Api(api)
        resource = client.ResourceV1Api(api)
        quiet = poll(
            lambda: (
                not churn.active()
                and not core.list_namespaced_pod(namespace).items
                and not resource.list_namespaced_resource_claim(namespace).items
            ),
            timeout_s=QUIESCE_S,
            interval_s=1.0,
        )
        if not quiet:
            pods = [p.metadata.name for p in core.list_namespaced_pod(namespace).items]
            problems.append(f"pods or claims not gone {QUIESCE_S:.0f} s after the churn: {pods}")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)

    # Unprepare runs before the pod object goes, but give the last ones a moment anyway.
    for name, node in nodes.items():
        left = poll(lambda n=node, b=baseline[name]: not leftovers(n, b, _dynamic(n)), 60)
        if not left:
            problems.extend(leftovers(node, baseline[name], _dynamic(node)))
        problems.extend(double_allocations(node))
        if not poll(lambda n=node: slices(resource, n.name), 60):
            problems.append(f"{name}: no ResourceSlice after the soak")
    problems.extend(p for p in chaos.dead_plugins() if p not in problems)

    events = _warning_events(api, namespace, set(nodes))
    reconciled = _reconciled(nodes)
    _print_summary(minutes, churned_s, seed, churn, chaos, events, checks, reconciled, problems)
    assert problems == []


_RECONCILE = re.compile(
    r"start-up reconcile: .*?kept (\d+), rolled back (\d+), rebuilt (\d+).*?removed (\d+) "
    r"orphan CDI spec\(s\), stopped (\d+) MPS daemon\(s\) and destroyed (\d+) MIG"
)
_RECONCILE_FIELDS = (
    "kept",
    "rolled back",
    "rebuilt",
    "orphan CDI specs removed",
    "MPS daemons stopped",
    "MIG instances destroyed",
)


def _reconciled(nodes: dict[str, SimulatedGpuNode]) -> Counter[str]:
    """What the start-up reconciles after the kills found and did, summed from the plugin
    logs: shows whether kills landed mid-prepare (rolled back) or left orphans."""
    totals: Counter[str] = Counter()
    for node in nodes.values():
        for log in (node.root / "logs").glob("plugin-*.log"):
            for match in _RECONCILE.finditer(log.read_text(errors="replace")):
                for key, value in zip(_RECONCILE_FIELDS, match.groups(), strict=True):
                    totals[key] += int(value)
    return totals


def _dynamic(node: SimulatedGpuNode) -> set[int]:
    return DYNAMIC_MIG if node.name == MIG else set()


def _print_summary(
    minutes: float,
    churned_s: float,
    seed: int,
    churn: Churn,
    chaos: Chaos,
    events: Counter[str],
    checks: Counter[str],
    reconciled: Counter[str],
    problems: list[str],
) -> None:
    c = churn.counts
    rows: list[tuple[str, str]] = [
        ("asked minutes / churned", f"{minutes:g} / {churned_s / 60:.1f} min"),
        ("seed", f"{SEED_ENV}={seed}"),
        ("workloads created", str(sum(c.created.values()))),
        ("pods that ran", str(sum(c.ran.values()))),
        ("pods that never ran (pending > 120 s)", str(sum(c.never_ran.values()))),
    ]
    rows += [
        (f"  {k}: created / ran / never ran", f"{c.created[k]} / {c.ran[k]} / {c.never_ran[k]}")
        for k in sorted(c.created)
    ]
    rows.append(("API errors met by the churn", str(c.api_errors)))
    rows += [(k, str(v)) for k, v in sorted(chaos.counts.items())]
    if chaos.slice_return_s:
        s = sorted(chaos.slice_return_s)
        rows.append(
            ("slices back after deletion (median / max)", f"{s[len(s) // 2]:.1f} / {s[-1]:.1f} s")
        )
    for reason in ("pod: FailedPrepareDynamicResources", "pod: FailedUnprepareDynamicResources"):
        rows.append((f"warning events, {reason}", str(events.pop(reason, 0))))
    rows += [(f"warning events, {k}", str(v)) for k, v in sorted(events.items())]
    rows += [(f"start-up reconciles: {k}", str(reconciled[k])) for k in _RECONCILE_FIELDS]
    rows.append(("invariant passes (every 2 s)", str(checks["invariant passes"])))
    for key in ("most prepared claims at once", "most CDI device grants at once"):
        rows.append((f"{key} (one node)", str(checks[key])))
    rows.append(("problems (double allocations, leaks, dead plugins)", str(len(problems))))
    width = max(len(k) for k, _ in rows)
    print("\n== soak summary ==")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for problem in problems:
        print(f"PROBLEM: {problem}")
