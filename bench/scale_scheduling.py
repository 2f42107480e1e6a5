"""The real scheduler placing a workload mix on hundreds of hollow GPU nodes, for several
publications of the same hardware, in one run:

    python -m bench.scale_scheduling [--nodes 100] [--pods 80] [--rounds 2] [--publications ...]

Each node is an HGX H100 (8 GPUs): GPUs 0-3 dynamic MIG, 4-5 shared, 6-7 whole. It is published
as flexgpu publishes it, as flexgpu with the dynamic-MIG GPUs' whole-GPU devices behind the 1g
partitions or behind every partition, or with the partitions placement by placement across the
GPUs, NVIDIA-style (every profile x placement in NVIDIA's order and counter layout), and as 8
whole GPUs (see ``bench.scale_publications``). Every node already carries load, written as
allocated claims: GPUs 0 and 1 hold seven 1g partitions each, GPU 2 a 3g at slice 0 and 1g at
slices 4-6, GPU 6 is taken (whole-only: GPUs 0-6 are taken). So a 1g claim must pass three
full GPUs before it finds room, as it would in a busy cluster. With
``--plain-taken`` GPU 7 is taken too, so a whole-GPU claim must go on to GPU 3, the free
dynamic-MIG GPU (whole-only: every GPU but GPU 3 is taken).

Per publication and round, batches of ``--pods`` pods, one claim each, of each kind (whole GPU;
1g.10gb partition; 10 GiB share), the same kind order for every publication of a round and
rotating between rounds, after an untimed warm-up batch of ``--warmup`` pods (the first batch
after a publication ran slower than later ones, so it landed on whichever kind came first,
even with the scheduler idle). Pods are created first; the scheduler cannot try them until
their claims exist, then the claims are created by several callers at once and the clock runs
from the first claim to the last pod bound. Publications alternate
within every round, so machine noise hits all alike. Reported per publication and kind: pods/s
(median of rounds) and the scheduler's CPU ms per pod, each batch timed once the scheduler is
idle (it digests a publication and the last batch's deletions for seconds); per publication:
slice objects, devices and JSON bytes in the apiserver; the machine's 1-minute load average
at every batch. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from bench.scale_cluster import (
    allocated_device,
    claim_body,
    clear_namespace,
    create_nodes,
    ensure_classes,
    hold,
    make_namespace,
    parallel,
    pod_body,
    process_cpu_s,
    publish,
    settle,
    slice_stats,
    unpublish,
    wait_for,
)
from bench.scale_publications import (
    FLEXGPU_ORDERS,
    PLACEMENT_MAJOR,
    PUBLICATIONS,
    NodeInventory,
    mig_device,
    scratch,
)
from flexgpu.driver.names import DRIVER_NAME
from tools.cluster import ControlPlane

A = f'device.attributes["{DRIVER_NAME}"]'
KINDS: dict[str, dict[str, Any]] = {
    "whole": {"deviceClassName": "gpu.flexgpu.dev"},
    "1g": {
        "deviceClassName": "mig.flexgpu.dev",
        "selectors": [{"cel": {"expression": f'{A}.profile == "1g.10gb"'}}],
    },
    "shared": {
        "deviceClassName": "shared-gpu.flexgpu.dev",
        "capacity": {"requests": {"memory": "10Gi"}},
    },
}
BATCH_DEADLINE_S = 240.0


@dataclass
class Figures:
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    cpu_ms: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    slices: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    publish_s: dict[str, list[float]] = field(default_factory=dict)
    load: list[float] = field(default_factory=list)


def load_average() -> float:
    """The machine's 1-minute load average (the apiserver, etcd and scheduler share it)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def background(publication: str, inv: NodeInventory, plain_taken: bool = False) -> list[str]:
    """The devices already taken on every node (the same silicon in every publication).
    ``plain_taken`` takes GPU 7 too, so a whole-GPU claim must go on to a dynamic-MIG GPU's
    whole-GPU device (whole-only: GPU 3 stays free instead of GPU 7)."""
    if publication == "whole-only":
        free = 3 if plain_taken else 7
        return [f"gpu-{i}" for i in range(8) if i != free]
    by_name = {p.name: p for p in inv.profiles}
    one, three = by_name["1g.10gb"], by_name["3g.40gb"]
    taken = [mig_device(publication, g, one, s) for g in (0, 1) for s in range(7)]
    taken.append(mig_device(publication, 2, three, 0))
    taken += [mig_device(publication, 2, one, s) for s in (4, 5, 6)]
    return [*taken, "gpu-6", *(["gpu-7"] if plain_taken else [])]


def load(
    api: Any,
    publication: str,
    namespace: str,
    nodes: dict[str, NodeInventory],
    plain_taken: bool = False,
) -> None:
    make_namespace(api, namespace)
    parallel(
        lambda n: hold(
            api, namespace, f"bg-{n}", n, background(publication, nodes[n], plain_taken)
        ),
        list(nodes),
    )


def probe(api: Any, namespace: str, kind: str) -> str:
    """One pod through the scheduler: proves it sees the publication and its load."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    core.create_namespaced_pod(namespace, pod_body("probe", "probe"))
    resource.create_namespaced_resource_claim(namespace, claim_body("probe", KINDS[kind]))
    wait_for(
        lambda: bool(core.read_namespaced_pod("probe", namespace).spec.node_name),
        BATCH_DEADLINE_S,
        f"probe pod in {namespace}",
    )
    device = allocated_device(api, namespace, "probe") or "?"
    core.delete_namespaced_pod("probe", namespace, grace_period_seconds=0)
    resource.delete_namespaced_resource_claim("probe", namespace)
    return device


def batch(
    api: Any, namespace: str, kind: str, pods: int, scheduler_pid: int | None
) -> tuple[float, float]:
    """Seconds from the first claim created to the last pod bound, and scheduler CPU ms/pod."""
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)
    make_namespace(api, namespace)
    names = [f"p{i}" for i in range(pods)]
    parallel(lambda n: core.create_namespaced_pod(namespace, pod_body(n, n)), names)
    settle(scheduler_pid)
    cpu0 = process_cpu_s(scheduler_pid)
    start = time.perf_counter()
    parallel(
        lambda n: resource.create_namespaced_resource_claim(namespace, claim_body(n, KINDS[kind])),
        names,
    )

    def all_bound() -> bool:
        listed = core.list_namespaced_pod(namespace).items
        return sum(1 for p in listed if p.spec.node_name) == pods

    wait_for(all_bound, BATCH_DEADLINE_S, f"{pods} {kind} pods bound in {namespace}")
    seconds = time.perf_counter() - start
    cpu = process_cpu_s(scheduler_pid) - cpu0
    clear_namespace(api, namespace)
    return seconds, cpu * 1000 / pods


def kinds_for(publication: str) -> list[str]:
    return ["whole"] if publication == "whole-only" else list(KINDS)


def run(args: argparse.Namespace, figures: Figures) -> None:
    started = time.monotonic()
    names = [f"gpu-node-{i:03d}" for i in range(args.nodes)]
    with ControlPlane() as plane:
        api = plane.api_client()
        ensure_classes(api)
        t0 = time.perf_counter()
        nodes = create_nodes(api, names, scratch())
        print(f"{args.nodes} hollow nodes registered in {time.perf_counter() - t0:.0f}s")
        pid = plane.component("kube-scheduler").pid
        publications: Sequence[str] = args.publications
        for round_ in range(args.rounds):
            shift = round_ % len(publications)
            for publication in [*publications[shift:], *publications[:shift]]:
                if time.monotonic() - started > args.max_minutes * 60:
                    print(f"stopping: --max-minutes {args.max_minutes} reached")
                    return
                t0 = time.perf_counter()
                publish(api, publication, nodes)
                figures.publish_s.setdefault(publication, []).append(time.perf_counter() - t0)
                figures.slices.setdefault(publication, slice_stats(api))
                bg = f"bg-{publication}-{round_}"
                load(api, publication, bg, nodes, args.plain_taken)
                kinds = kinds_for(publication)
                kinds = kinds[round_ % len(kinds) :] + kinds[: round_ % len(kinds)]
                probe_ns = f"probe-{publication}-{round_}"
                make_namespace(api, probe_ns)
                placed = probe(api, probe_ns, kinds[0])
                client.CoreV1Api(api).delete_namespace(probe_ns)
                if args.warmup:
                    warm_ns = f"warmup-{publication}-{round_}"
                    seconds, cpu = batch(api, warm_ns, kinds[0], args.warmup, pid)
                    print(
                        f"  round {round_ + 1} {publication:24s} warm-up {kinds[0]:6s} "
                        f"{args.warmup / seconds:6.1f} pods/s  scheduler {cpu:5.0f} ms CPU/pod"
                        " (not counted)",
                        flush=True,
                    )
                for kind in kinds:
                    namespace = f"{publication}-{kind}-{round_}"
                    seconds, cpu = batch(api, namespace, kind, args.pods, pid)
                    figures.rates.setdefault((publication, kind), []).append(args.pods / seconds)
                    figures.cpu_ms.setdefault((publication, kind), []).append(cpu)
                    figures.load.append(load_average())
                    print(
                        f"  round {round_ + 1} {publication:24s} {kind:6s} "
                        f"{args.pods / seconds:6.1f} pods/s  scheduler {cpu:5.0f} ms CPU/pod"
                        f"  load {figures.load[-1]:.1f}"
                        + (f"  (probe took {placed})" if kind == kinds[0] else ""),
                        flush=True,
                    )
                clear_namespace(api, bg)
                unpublish(api)


def report(args: argparse.Namespace, figures: Figures) -> None:
    print()
    print(
        f"{args.nodes} nodes x 8 H100 (4 dynamic MIG, 2 shared, 2 whole), {args.pods} pods per "
        f"batch, {args.rounds} rounds, publications alternating"
        + (", both plain GPUs taken" if args.plain_taken else "")
    )
    if figures.load:
        print(
            f"1-minute load average at the batches: {min(figures.load):.1f}-{max(figures.load):.1f}"
        )
    print(f"{'publication':24s}{'slices':>8s}{'devices':>9s}{'MiB':>8s}{'publish s':>11s}")
    for publication, (count, devices, size) in figures.slices.items():
        publish_s = statistics.median(figures.publish_s[publication])
        print(f"{publication:24s}{count:8d}{devices:9d}{size / 2**20:8.1f}{publish_s:11.0f}")
    print(f"{'publication':24s}{'kind':8s}{'pods/s':>8s}{'sched CPU ms/pod':>18s}  rounds")
    for (publication, kind), rates in figures.rates.items():
        cpus = figures.cpu_ms[(publication, kind)]
        print(
            f"{publication:24s}{kind:8s}{statistics.median(rates):8.1f}"
            f"{statistics.median(cpus):18.0f}  "
            + ", ".join(f"{r:.1f} ({c:.0f} ms)" for r, c in zip(rates, cpus, strict=True))
        )
    med = {k: statistics.median(v) for k, v in figures.rates.items()}
    for publication in args.publications:
        if (publication, "1g") in med and (publication, "whole") in med:
            print(
                f"1g / whole on {publication}: "
                f"{med[(publication, '1g')] / med[(publication, 'whole')]:.2f}"
            )
    for publication in [*FLEXGPU_ORDERS, PLACEMENT_MAJOR]:
        if (publication, "1g") in med and ("whole-only", "whole") in med:
            print(
                f"{publication} 1g / whole-only whole: "
                f"{med[(publication, '1g')] / med[('whole-only', 'whole')]:.2f}"
            )
    if ("flexgpu", "1g") in med and ("nvidia-style", "1g") in med:
        print(
            "flexgpu 1g / NVIDIA-style 1g: "
            f"{med[('flexgpu', '1g')] / med[('nvidia-style', '1g')]:.2f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--pods", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--warmup", type=int, default=10, help="untimed pods before each publication's batches"
    )
    parser.add_argument(
        "--plain-taken",
        action="store_true",
        help="the load takes both plain GPUs too (whole-GPU claims go to dynamic-MIG GPUs)",
    )
    parser.add_argument("--publications", type=lambda s: s.split(","), default=list(PUBLICATIONS))
    parser.add_argument("--max-minutes", type=float, default=20.0)
    args = parser.parse_args(argv)
    unknown = set(args.publications) - set(PUBLICATIONS)
    if unknown:
        parser.error(f"--publications: unknown {sorted(unknown)}; allowed: {PUBLICATIONS}")
    if args.pods > args.nodes:
        parser.error("--pods must be at most --nodes (one free whole GPU per node is certain)")
    figures = Figures()
    try:
        run(args, figures)
    finally:
        report(args, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
