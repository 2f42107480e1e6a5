"""How well a publication packs MIG partitions while requests come and go: one trace of
requests of mixed sizes (1g to 7g and whole GPUs), replayed step by step through the real
scheduler against flexgpu's publication and the NVIDIA-style one side by side (or the
publications named by ``--publications``, from ``bench.scale_publications.PUBLICATIONS``):

    python -m bench.packing_churn [--nodes 1] [--steps 40] [--seed 7] [--arrivals-per-gpu 0.3]
        [--publications flexgpu,nvidia-style] [--clearing SHARE] [--record FILE]

Each publication gets its own ``--nodes`` hollow HGX H100 nodes with all 8 GPUs in dynamic MIG
(``bench.scale_publications``); every request of the trace is made once for each group
(a pod pinned to the group by node selector, with its own claim). A request arrives at a step
and, once placed, holds its partition for its lifetime in steps, then leaves; one that cannot
be placed waits. After each step's arrivals and departures the scheduler is given until no pod
has been placed for a few seconds. Reported per publication: for the large requests (3g, 4g,
7g, whole GPU) how many were placed by the end and their mean wait in steps, and the same for
the small ones. Both groups share one scheduler and the same clock, so noise hits both alike.
Nothing is asserted. ``--clearing`` runs flexgpu's controller beside the replay with GPU
clearing at that share of the GPUs (``--clearing-share``, pending delay 1 s), so large
requests that wait get a GPU steered for them; compare with a run without it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client

from bench.packing_record import Recorder
from bench.scale_cluster import (
    claim_body,
    create_nodes,
    ensure_classes,
    make_namespace,
    parallel,
    pod_body,
    publish,
)
from bench.scale_publications import PUBLICATIONS as KNOWN
from bench.scale_publications import scratch
from flexgpu.driver.names import DRIVER_NAME
from tools.cluster import ControlPlane

A = f'device.attributes["{DRIVER_NAME}"]'
GROUP_LABEL = "bench.flexgpu.dev/group"
PUBLICATIONS = ("flexgpu", "nvidia-style")
# Request kinds, how often each arrives, and whether it counts as large.
KINDS: dict[str, tuple[float, bool]] = {
    "1g.10gb": (0.34, False),
    "1g.20gb": (0.08, False),
    "2g.20gb": (0.16, False),
    "3g.40gb": (0.16, True),
    "4g.40gb": (0.10, True),
    "7g.80gb": (0.06, True),
    "whole": (0.10, True),
}
QUIET_S = 3.0  # no pod placed for this long: the step has settled
STEP_LIMIT_S = 30.0


@dataclass
class Request:
    ident: int
    kind: str
    arrives: int
    lifetime: int
    placed: dict[str, int] = field(default_factory=dict)  # publication -> step placed
    gone: set[str] = field(default_factory=set)


def trace(steps: int, per_gpu: float, gpus: int, seed: int) -> list[Request]:
    """Arrivals per step drawn around ``per_gpu`` x ``gpus``: with the sizes above (3.1 memory
    slices on average) and lifetimes of 3-12 steps, 0.3 per GPU keeps the GPUs about 90% full,
    where placement decides what still fits."""
    rng = random.Random(seed)
    kinds = list(KINDS)
    weights = [KINDS[k][0] for k in kinds]
    mean = per_gpu * gpus
    out: list[Request] = []
    for step in range(steps):
        count = max(0, round(rng.gauss(mean, mean / 3)))
        for _ in range(count):
            kind = rng.choices(kinds, weights)[0]
            out.append(Request(len(out), kind, step, rng.randint(3, 12)))
    return out


def request_spec(kind: str) -> dict[str, Any]:
    if kind == "whole":
        return {"deviceClassName": "gpu.flexgpu.dev"}
    return {
        "deviceClassName": "mig.flexgpu.dev",
        "selectors": [{"cel": {"expression": f'{A}.profile == "{kind}"'}}],
    }


def namespace_of(publication: str) -> str:
    return f"pack-{publication}"


def arrive(api: Any, requests: Sequence[Request], publications: Sequence[str]) -> None:
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)

    def one(item: tuple[str, Request]) -> None:
        publication, request = item
        ns, name = namespace_of(publication), f"r{request.ident}"
        resource.create_namespaced_resource_claim(ns, claim_body(name, request_spec(request.kind)))
        core.create_namespaced_pod(ns, pod_body(name, name, {GROUP_LABEL: publication}))

    parallel(one, [(p, r) for r in requests for p in publications])


def leave(api: Any, items: Sequence[tuple[str, Request]]) -> None:
    core: Any = client.CoreV1Api(api)
    resource: Any = client.ResourceV1Api(api)

    def one(item: tuple[str, Request]) -> None:
        publication, request = item
        ns, name = namespace_of(publication), f"r{request.ident}"
        core.delete_namespaced_pod(name, ns, grace_period_seconds=0)
        resource.delete_namespaced_resource_claim(name, ns)
        request.gone.add(publication)

    parallel(one, items)


def bound(api: Any, publications: Sequence[str]) -> set[tuple[str, int]]:
    core: Any = client.CoreV1Api(api)
    found = set()
    for publication in publications:
        for pod in core.list_namespaced_pod(namespace_of(publication)).items:
            if pod.spec.node_name:
                found.add((publication, int(pod.metadata.name[1:])))
    return found


def settle(api: Any, publications: Sequence[str]) -> set[tuple[str, int]]:
    """Waits until no new pod has been placed for QUIET_S (or STEP_LIMIT_S passed)."""
    start = last_change = time.monotonic()
    seen = bound(api, publications)
    while time.monotonic() - last_change < QUIET_S and time.monotonic() - start < STEP_LIMIT_S:
        time.sleep(0.5)
        now = bound(api, publications)
        if now != seen:
            seen, last_change = now, time.monotonic()
    return seen


def replay(
    api: Any,
    requests: list[Request],
    steps: int,
    publications: Sequence[str],
    recorder: Recorder | None = None,
) -> None:
    by_id = {r.ident: r for r in requests}
    for step in range(steps):
        leaving = [
            (p, r)
            for r in requests
            for p, at in r.placed.items()
            if p not in r.gone and at + r.lifetime <= step
        ]
        leave(api, leaving)
        arrive(api, [r for r in requests if r.arrives == step], publications)
        for publication, ident in settle(api, publications):
            by_id[ident].placed.setdefault(publication, step)
        if recorder is not None:
            recorder.step(api, step, {p: namespace_of(p) for p in publications})
        waiting = {
            p: sum(1 for r in requests if r.arrives <= step and p not in r.placed)
            for p in publications
        }
        print(
            f"  step {step + 1:3d}: {len(leaving):2d} left, "
            f"{sum(1 for r in requests if r.arrives == step):2d} arrived, waiting "
            + ", ".join(f"{p} {n}" for p, n in waiting.items()),
            flush=True,
        )


def report(requests: Sequence[Request], args: argparse.Namespace) -> None:
    print()
    print(
        f"{len(requests)} requests over {args.steps} steps (seed {args.seed}), "
        f"{args.nodes} nodes x 8 H100 in dynamic MIG per publication, GPU clearing "
        + (f"at share {args.clearing}" if args.clearing else "off")
    )
    print(
        f"{'publication':24s}{'size':7s}{'arrived':>9s}{'placed':>8s}{'mean wait':>11s}"
        f"{'p90 wait':>10s}"
    )
    for publication in args.publications:
        for large in (True, False):
            mine = [r for r in requests if KINDS[r.kind][1] == large]
            waits = sorted(
                r.placed[publication] - r.arrives for r in mine if publication in r.placed
            )
            mean = statistics.mean(waits) if waits else 0.0
            p90 = waits[min(len(waits) - 1, round(0.9 * (len(waits) - 1)))] if waits else 0
            print(
                f"{publication:24s}{'large' if large else 'small':7s}{len(mine):9d}"
                f"{len(waits):8d}{mean:11.2f}{p90:10d}"
            )
    print(f"per kind (placed {' / '.join(args.publications)} of arrived):")
    for kind in KINDS:
        mine = [r for r in requests if r.kind == kind]
        got = [sum(1 for r in mine if p in r.placed) for p in args.publications]
        print(f"  {kind:8s} " + " / ".join(f"{n:3d}" for n in got) + f" of {len(mine)}")


def start_controller(plane: ControlPlane, share: float) -> subprocess.Popen[bytes]:
    """flexgpu's controller with GPU clearing, its log in the control plane's folder."""
    log = (plane.workdir / "controller.log").open("wb")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flexgpu.controller.main",
            f"--kubeconfig={plane.kubeconfig}",
            "--namespace=default",
            "--pending-delay=1",
            "--metrics-port=0",
            "--no-webhook",
            f"--clearing-share={share}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def clearings(api: Any, publications: Sequence[str]) -> int:
    """GpuClearing Events the controller recorded on the replay's pods."""
    core: Any = client.CoreV1Api(api)
    return sum(
        1
        for p in publications
        for e in core.list_namespaced_event(namespace_of(p)).items
        if e.reason == "GpuClearing" and e.involved_object.kind == "Pod"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--arrivals-per-gpu", type=float, default=0.3)
    parser.add_argument("--publications", type=lambda s: s.split(","), default=list(PUBLICATIONS))
    parser.add_argument("--clearing", type=float, default=0.0, metavar="SHARE")
    parser.add_argument(
        "--record", type=Path, default=None, help="one JSON line per step (bench.packing_record)"
    )
    args = parser.parse_args(argv)
    unknown = set(args.publications) - set(KNOWN)
    if unknown:
        parser.error(f"--publications: unknown {sorted(unknown)}; allowed: {KNOWN}")
    requests = trace(args.steps, args.arrivals_per_gpu, 8 * args.nodes, args.seed)
    every = frozenset(range(8))
    with ControlPlane() as plane:
        api = plane.api_client()
        ensure_classes(api)
        folder = scratch()
        for publication in args.publications:
            names = [f"{publication}-{i}" for i in range(args.nodes)]
            nodes = create_nodes(
                api,
                names,
                folder,
                labels={GROUP_LABEL: publication},
                dynamic=every,
                shared=frozenset(),
            )
            publish(api, publication, nodes)
            make_namespace(api, namespace_of(publication))
        controller = start_controller(plane, args.clearing) if args.clearing else None
        recorder = Recorder(args.record)
        recorder.header(requests, args.steps)
        try:
            replay(api, requests, args.steps, args.publications, recorder)
        finally:
            recorder.close()
            report(requests, args)
            if controller is not None:
                print(f"GPU clearings started: {clearings(api, args.publications)}")
                controller.terminate()
                try:
                    controller.wait(30)
                except subprocess.TimeoutExpired:
                    controller.kill()
                    controller.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
