"""Soak: three simulated nodes under pod churn of every claim kind while the plugin is
SIGKILLed, the apiserver restarts and slices are deleted at random. Proves that no two prepared
claims ever hold the same exclusive device, and that once every pod is gone nothing is left:
no claim record, CDI spec, MIG instance, MPS daemon or changed GPU setting, and every node has
its slices. Runs only with FLEXGPU_SOAK_MINUTES set (see docs/development.md)."""

from __future__ import annotations

import os
import random
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tests.integration.gpu_workloads import ensure_device_classes
from tests.soak.churn import DRIVER, Churn, kinds
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


def _slices(resource: Any, node: str) -> list[Any]:
    selector = f"spec.nodeName={node},spec.driver={DRIVER}"
    return list(resource.list_resource_slice(field_selector=selector).items)


def _poll(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.5) -> Any:
    """The first truthy answer of predicate within timeout_s, else None; API errors (an
    apiserver restarting) count as a falsy answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = predicate()
        except Exception:
            answer = None
        if answer:
            return answer
        time.sleep(interval_s)
    return None


class Chaos:
    """Random faults, one at a time: plugin SIGKILL (the test starts it again), apiserver
    restart with a short outage, deletion of a node's ResourceSlices."""

    def __init__(
        self,
        cluster: ControlPlane,
        nodes: dict[str, SimulatedGpuNode],
        rng: random.Random,
        problems: list[str],
    ) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.rng = rng
        self.problems = problems
        self.resource = client.ResourceV1Api(cluster.api_client())
        self.counts: Counter[str] = Counter()
        self.slice_return_s: list[float] = []
        self.plugin_lock = threading.Lock()

    def act(self) -> None:
        action = self.rng.choices(["kill", "apiserver", "slices"], weights=[5, 2, 3])[0]
        node = self.rng.choice(list(self.nodes.values()))
        if action == "kill":
            with self.plugin_lock:
                node.stop_plugin(signal.SIGKILL)
                self.counts[f"plugin SIGKILL ({node.name})"] += 1
                node.start_plugin(timeout_s=180)
        elif action == "apiserver":
            self.cluster.restart_apiserver(down_s=self.rng.uniform(1.0, 5.0))
            self.counts["apiserver restart"] += 1
        else:
            before = {s.metadata.uid for s in _slices(self.resource, node.name)}
            self.resource.delete_collection_resource_slice(
                field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}"
            )
            self.counts[f"slices deleted ({node.name})"] += 1
            start = time.monotonic()
            back = _poll(
                lambda: [
                    s for s in _slices(self.resource, node.name) if s.metadata.uid not in before
                ],
                timeout_s=120,
            )
            if back:
                self.slice_return_s.append(time.monotonic() - start)
            else:
                self.problems.append(f"{node.name}: slices not back 120 s after deletion")

    def dead_plugins(self) -> list[str]:
        """Plugins that exited without being killed by chaos."""
        with self.plugin_lock:
            return [
                f"{n.name}: plugin exited with {n.plugin.exit_code()} unasked "
                f"(log {n.plugin.log_path})"
                for n in self.nodes.values()
                if n.plugin is not None and not n.plugin.running()
            ]


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
        while time.monotonic() < end and not problems:
            stop.wait(min(rng.uniform(*CHAOS_GAP_S), max(0.0, end - time.monotonic())))
            if time.monotonic() < end:
                try:
                    chaos.act()
                except Exception as exc:  # a plugin or apiserver that did not come back
                    problems.append(f"chaos action failed: {exc}")
        churned_s = time.monotonic() - started

        # Quiesce: no new workloads, every pod and claim deleted and gone.
        creating.clear()
        churn.delete_all()
        core = client.CoreV1Api(api)
        resource = client.ResourceV1Api(api)
        quiet = _poll(
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
        left = _poll(lambda n=node, b=baseline[name]: not leftovers(n, b, _dynamic(n)), 60)
        if not left:
            problems.extend(leftovers(node, baseline[name], _dynamic(node)))
        problems.extend(double_allocations(node))
        if not _poll(lambda n=node: _slices(resource, n.name), 60):
            problems.append(f"{name}: no ResourceSlice after the soak")
    problems.extend(p for p in chaos.dead_plugins() if p not in problems)

    events = _warning_events(api, namespace, set(nodes))
    _print_summary(minutes, churned_s, seed, churn, chaos, events, checks, problems)
    assert problems == []


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
