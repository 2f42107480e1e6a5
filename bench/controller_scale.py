"""Controller memory and explanation latency on a large simulated cluster, no apiserver needed:

    python -m bench.controller_scale [--nodes 100] [--claims 5000] [--samples 200]

The cluster is generated as API objects (what the watches would deliver) and fed through the
controller's own ``ClusterState`` converters: ``--nodes`` H100 nodes of 8 GPUs (a quarter of
them publishing shared GPUs), ``--claims`` claims of which most hold devices (every whole GPU,
and 1-3 GiB shares on the shared GPUs) and the rest are unallocated, each wanted by a pending
pod pinned to a zone. It reports:

- the resident memory the cache adds (RSS after loading minus before, generated objects freed),
  and the process's resident memory after the passes;
- p50/p99 of one diagnosis (``evaluate`` + the Event text) over ``--samples`` pending claims,
  each on its own (selector results shared, as the controller keeps them while no slice
  changes, but no explanation shared): what ``flexgpu explain`` costs for one claim;
- p50/p99 of one diagnosis inside a pass over every pending claim, where claims that ask the
  same of the same nodes share one explanation (``controller.evaluation.Memo``);
- the time of a full diagnostics pass over every pending claim (what a new leader does first).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from flexgpu.controller.cluster_state import ClusterState
from flexgpu.controller.diagnostics import Diagnostics
from flexgpu.controller.evaluation import Memo, evaluate
from flexgpu.controller.events import EventTarget
from flexgpu.controller.messages import Lookup, pod_message
from flexgpu.controller.pending import pending_claims
from flexgpu.driver.allocation.selectors import SelectorCache
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.resource_slice import render_node_gpus, slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology

NOW = datetime.now(UTC)
GPUS_PER_NODE = 8
SHARES_PER_GPU = 20
ZONES = ("a", "b", "c", "d")
A = f'device.attributes["{DRIVER_NAME}"]'


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _stamp(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gpu_devices(shared: bool) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as folder:
        backend = SimulatedBackend(load_topology("hgx-h100-8"), "n", Path(folder) / "s.json")
        return render_node_gpus(backend.list_gpus(), shared=set(range(8)) if shared else set())


class Cluster:
    def __init__(self, nodes: int, claims: int, seed: int = 7) -> None:
        self.node_names = [f"gpu-node-{i:03d}" for i in range(nodes)]
        self.shared_nodes = set(self.node_names[: nodes // 4])
        self.claims = claims
        self.rng = random.Random(seed)
        self._whole, self._shared = _gpu_devices(False), _gpu_devices(True)

    def nodes(self) -> Iterator[dict[str, Any]]:
        for i, name in enumerate(self.node_names):
            labels = {"kubernetes.io/hostname": name, "zone": ZONES[i % len(ZONES)]}
            yield {"metadata": {"name": name, "labels": labels}, "spec": {}}

    def slices(self) -> Iterator[dict[str, Any]]:
        for name in self.node_names:
            devices = self._shared if name in self.shared_nodes else self._whole
            for k, spec in enumerate(slice_specs(name, devices, 1)):
                yield {"metadata": {"name": f"{name}-{k}"}, "spec": spec}

    def classes(self) -> Iterator[dict[str, Any]]:
        for name, kind in (("gpu.flexgpu.dev", "gpu"), ("shared-gpu.flexgpu.dev", "shared")):
            expression = f'device.driver == "{DRIVER_NAME}" && {A}.type == "{kind}"'
            yield {
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": expression}}]},
            }

    def _claim(self, i: int, request: dict[str, Any], results: Any = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "metadata": {
                "name": f"claim-{i}",
                "namespace": f"team-{i % 20}",
                "uid": f"uid-{i}",
                "creationTimestamp": _stamp(600),
            },
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": request}]}},
        }
        if results is not None:
            body["status"] = {"allocation": {"devices": {"results": results}}}
        return body

    def _holders(self) -> Iterator[dict[str, Any]]:
        """Every whole GPU held by one claim, and the shared GPUs by up to 20 shares each."""
        i = 0
        for name in self.node_names:
            for g in range(GPUS_PER_NODE):
                if i >= self.claims:
                    return
                device = {"request": "gpu", "driver": DRIVER_NAME, "pool": name}
                if name not in self.shared_nodes:
                    yield self._claim(
                        i,
                        {"deviceClassName": "gpu.flexgpu.dev"},
                        [{**device, "device": f"gpu-{g}"}],
                    )
                    i += 1
                    continue
                for _ in range(SHARES_PER_GPU):
                    if i >= self.claims:
                        return
                    memory = f"{self.rng.choice((1, 2, 3))}Gi"
                    result = {
                        **device,
                        "device": f"gpu-{g}",
                        "shareID": f"share-{i}",
                        "consumedCapacity": {"memory": memory, "compute": "4"},
                    }
                    request = {
                        "deviceClassName": "shared-gpu.flexgpu.dev",
                        "capacity": {"requests": {"memory": memory, "compute": "4"}},
                    }
                    yield self._claim(i, request, [result])
                    i += 1

    def pending_count(self) -> int:
        """What is left once every device is taken; a tenth when claims are fewer."""
        held = len(self.node_names) * GPUS_PER_NODE - len(self.shared_nodes) * GPUS_PER_NODE
        held += len(self.shared_nodes) * GPUS_PER_NODE * SHARES_PER_GPU
        return self.claims - held if self.claims > held else self.claims // 10

    def all_claims(self) -> Iterator[dict[str, Any]]:
        pending = self.pending_count()
        yield from self._holders_limited(self.claims - pending)
        for k in range(pending):
            i = self.claims - pending + k
            yield self._claim(i, self._pending_request(k))

    def _holders_limited(self, limit: int) -> Iterator[dict[str, Any]]:
        for n, claim in enumerate(self._holders()):
            if n >= limit:
                return
            yield claim

    def _pending_request(self, k: int) -> dict[str, Any]:
        kind = k % 3
        if kind == 0:  # more whole GPUs than any node has free
            return {"deviceClassName": "gpu.flexgpu.dev", "count": 2}
        if kind == 1:  # a share larger than what is left anywhere
            return {
                "deviceClassName": "shared-gpu.flexgpu.dev",
                "capacity": {"requests": {"memory": "60Gi"}},
            }
        return {  # a near miss: memory no H100 has
            "deviceClassName": "gpu.flexgpu.dev",
            "selectors": [
                {
                    "cel": {
                        "expression": f'device.capacity["{DRIVER_NAME}"].memory.compareTo('
                        'quantity("100Gi")) >= 0'
                    }
                }
            ],
        }

    def pods(self) -> Iterator[dict[str, Any]]:
        pending = self.pending_count()
        for k in range(pending):
            i = self.claims - pending + k
            yield {
                "metadata": {
                    "name": f"pod-{i}",
                    "namespace": f"team-{i % 20}",
                    "uid": f"pod-uid-{i}",
                    "creationTimestamp": _stamp(300),
                },
                "spec": {
                    "nodeSelector": {"zone": ZONES[k % len(ZONES)]},
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": f"claim-{i}"}],
                },
                "status": {"phase": "Pending"},
            }


class NullSink:
    def emit(self, target: EventTarget, reason: str, message: str, *, repeat: bool) -> None:
        del target, reason, message, repeat


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--claims", type=int, default=5000)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()

    cluster = Cluster(args.nodes, args.claims)
    gc.collect()
    before = rss_mib()
    state = ClusterState()
    started = time.perf_counter()
    state.replace("nodes", cluster.nodes())
    state.replace("classes", cluster.classes())
    state.replace("slices", cluster.slices())
    state.replace("claims", cluster.all_claims())
    state.replace("pods", cluster.pods())
    state.replace("policies", [])
    load_s = time.perf_counter() - started
    gc.collect()
    after = rss_mib()
    counts = state.counts()
    snapshot = state.snapshot()
    devices = sum(len(s.devices) for s in snapshot.slices.values())
    print(
        f"cluster: {counts['nodes']} nodes, {devices} devices in {counts['slices']} slices, "
        f"{counts['claims']} claims, {counts['pods']} pending pods"
    )
    print(
        f"cache: +{after - before:.1f} MiB resident ({after:.1f} MiB total), "
        f"loaded in {load_s:.2f}s"
    )

    pending = list(pending_claims(snapshot, NOW, 30))
    lookup = Lookup(snapshot)
    times, samples = [], pending[: args.samples]
    example = ""
    selectors = SelectorCache()  # as the controller keeps it while no slice changes
    t0 = time.perf_counter()
    evaluate(snapshot, samples[0].claim, samples[0].pod, selectors, lookup.state)
    print(f"first diagnosis (CEL over every device): {(time.perf_counter() - t0) * 1000:.0f} ms")
    for item in samples:
        t0 = time.perf_counter()
        ev = evaluate(snapshot, item.claim, item.pod, selectors, lookup.state)
        text = pod_message(ev, lookup)
        times.append(time.perf_counter() - t0)
        example = example or text
    print(
        f"one diagnosis ({len(samples)} pending claims): "
        f"p50 {percentile(times, 50) * 1000:.1f} ms, "
        f"p99 {percentile(times, 99) * 1000:.1f} ms, mean {statistics.mean(times) * 1000:.1f} ms"
    )
    in_pass, memo = [], Memo()
    pass_lookup, pass_selectors = Lookup(snapshot), SelectorCache()
    for item in pending:
        t0 = time.perf_counter()
        ev = evaluate(snapshot, item.claim, item.pod, pass_selectors, pass_lookup.state, memo=memo)
        pod_message(ev, pass_lookup)
        in_pass.append(time.perf_counter() - t0)
    print(
        f"one diagnosis within a pass ({len(pending)} pending claims, "
        f"{len(memo.explanations)} distinct): p50 {percentile(in_pass, 50) * 1000:.1f} ms, "
        f"p99 {percentile(in_pass, 99) * 1000:.1f} ms, max {max(in_pass) * 1000:.0f} ms"
    )
    del memo, pass_lookup, pass_selectors
    diagnostics = Diagnostics(NullSink(), delay_s=30)
    t0 = time.perf_counter()
    result = diagnostics.run_pass(snapshot, NOW)
    print(
        f"first leader pass: {result.explained} claims explained, {result.unsatisfiable} "
        f"unsatisfiable, {time.perf_counter() - t0:.1f}s; a second pass with nothing changed: ",
        end="",
    )
    t0 = time.perf_counter()
    diagnostics.run_pass(snapshot, NOW)
    print(f"{(time.perf_counter() - t0) * 1000:.0f} ms")
    gc.collect()
    print(f"resident memory after the passes: {rss_mib():.1f} MiB")
    print(f"example: {example}")


if __name__ == "__main__":
    main()
