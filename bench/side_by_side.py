"""SIMULATION, not a measurement of a cluster: the same day of GPU claims
(``bench.autoscale_trace``) replayed through the autoscaler model of ``bench.autoscale_replay``
for six setups of the same HGX H100 node group (``bench.side_by_side_setups``):

    python -m bench.side_by_side [--seed 7] [--days 1] [--boot-minutes 6]
        [--idle-minutes 10] [--max-nodes 40] [--fixed-nodes N] [--evict-after 10]
        [--restart-minutes 5] [--packing]

(a) NVIDIA's device plugin, (b) NVIDIA's DRA driver, (c) flexgpu today, (c2) flexgpu with
(b)'s policy (every GPU on-demand MIG), (d) and (d2): (c)'s and (c2)'s groups with node
steering and consolidation (``bench.steering_replay``: new claims kept off the nodes closest
to empty, opted-in inference pods moved off a node steered ``--evict-after`` minutes, each
losing ``--restart-minutes``; 0 moves nobody). (d) against (c) and (d2) against (c2) are
steering's part, (c2) against (c) the policy's.
Every placement is decided by ``driver.allocation``, the offline copy of kube-scheduler's
allocator held to it by a differential test; nodes come and go as the model's autoscaler
launches and removes them (or, with ``--fixed-nodes``, a group of that many nodes serves all
day, so the setups differ in what they place and how long claims wait).

Reported per setup: GPU-hours provisioned (nodes x 8 x hours, billed from launch) and used
(each claim's GPU-equivalents x its run time, a moved claim's restart included),
used/provisioned, large claims (4-GPU and 1-GPU training, 3g.40gb inference) and small ones
(1g.10gb, 20 GiB share) placed by the end, pending-to-running waits in minutes as p50/p95/max
(nearest-rank percentiles over the claims placed, each claim's first start), and evictions
(counted for (d) and (d2); none in the other setups, said so); then flexgpu's ratios against
(a) and (b), and steering's and the policy's parts.

``--packing`` also runs ``bench.packing_churn`` afterwards (real kube-scheduler, hollow
nodes: flexgpu's publication against NVIDIA's DRA publication, minutes). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Final

from bench.autoscale_replay import Claim, Cluster, RunResult, replay
from bench.autoscale_trace import BY_NAME, day_trace
from bench.side_by_side_setups import Setup, setups
from bench.side_by_side_table import Column, Figures, ratios, table
from bench.steering_replay import NodeSteering, SteeringOptions

LARGE_KINDS: Final = frozenset({"train-4gpu-nvlink", "train-1gpu", "infer-mig-3g"})
GPUS_PER_NODE: Final = 8
FLEXGPU: Final = ("c", "c2", "d", "d2")
NVIDIA: Final = ("a", "b")
# Steering's part, the policy's part, and both against flexgpu today.
STEERING_PAIRS: Final = (("d", "c"), ("d2", "c2"), ("c2", "c"), ("d2", "c"))


def figures_of(result: RunResult, evictions: int | None = None) -> Figures:
    """The table's figures from one replay."""
    large = [c for c in result.claims if c.arrival.kind in LARGE_KINDS]
    small = [c for c in result.claims if c.arrival.kind not in LARGE_KINDS]

    def waits(claims: Sequence[Claim]) -> tuple[float, ...]:
        return tuple(float(c.started - c.arrival.minute) for c in claims if c.started is not None)

    return Figures(
        provisioned_gpu_hours=result.node_minutes * GPUS_PER_NODE / 60,
        used_gpu_hours=result.used_gpu_minutes / 60,
        large_placed=sum(1 for c in large if c.started is not None),
        large_total=len(large),
        small_placed=sum(1 for c in small if c.started is not None),
        small_total=len(small),
        small_waits=waits(small),
        large_waits=waits(large),
        evictions=evictions,
    )


def run_setup(setup: Setup, args: argparse.Namespace) -> Column:
    if setup.template is None:
        return Column(setup.key, setup.label, None, setup.not_run)
    steering = NodeSteering(setup.steering) if setup.steering is not None else None
    result = replay(
        day_trace(args.seed, args.days),
        Cluster(setup.template, setup.classes, setup.claims),
        autoscale=not args.fixed_nodes,
        fixed_nodes=args.fixed_nodes,
        boot_minutes=args.boot_minutes,
        idle_minutes=args.idle_minutes,
        max_nodes=args.max_nodes,
        steering=steering,
    )
    evictions = steering.evictions if steering is not None else None
    return Column(setup.key, setup.label, figures_of(result, evictions))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.side_by_side", description=__doc__)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--days", type=int, default=1)
    parser.add_argument("--boot-minutes", type=int, default=6)
    parser.add_argument("--idle-minutes", type=int, default=10)
    parser.add_argument("--max-nodes", type=int, default=40)
    parser.add_argument(
        "--fixed-nodes",
        type=int,
        default=0,
        help="a fixed group of this many nodes all day instead of the autoscaler model",
    )
    parser.add_argument(
        "--evict-after",
        type=int,
        default=SteeringOptions.evict_after_minutes,
        help="(d): move opted-in pods off a node steered this many minutes (0: move nobody)",
    )
    parser.add_argument(
        "--restart-minutes",
        type=int,
        default=SteeringOptions.restart_minutes,
        help="(d): minutes a moved claim loses to starting again elsewhere",
    )
    parser.add_argument("--packing", action="store_true", help="also run bench.packing_churn")
    args = parser.parse_args(argv)
    options = SteeringOptions(
        evict_after_minutes=args.evict_after or None, restart_minutes=args.restart_minutes
    )
    start = time.monotonic()
    trace = day_trace(args.seed, args.days)
    counts = ", ".join(f"{k} {sum(1 for a in trace if a.kind == k)}" for k in BY_NAME)
    print(
        f"SIMULATION: {len(trace)} claims over {args.days} day(s), seed {args.seed} ({counts}); "
        + (
            f"a fixed group of {args.fixed_nodes} HGX H100 x8 nodes"
            if args.fixed_nodes
            else f"autoscaled HGX H100 x8 nodes, boot {args.boot_minutes} min, scale-down after "
            f"{args.idle_minutes} idle min, at most {args.max_nodes} nodes"
        )
    )
    columns = []
    for setup in setups(options):
        columns.append(run_setup(setup, args))
        print(
            f"  ({setup.key}) {setup.label}: done at {time.monotonic() - start:.0f} s", flush=True
        )
    print()
    print("\n".join(table(columns)))
    print("waits: minutes from pending to running, nearest-rank percentiles over placed claims")
    print(
        "evictions: (a)-(c2) move nobody: the model removes only empty nodes, nothing preempts "
        "and no MIG layout is re-cut under running pods; (d), (d2): "
        + (
            f"inference pods (Deployments, opted in) moved off a node steered "
            f"{options.evict_after_minutes} min, {options.max_in_flight} at a time, each "
            f"restarting elsewhere in {options.restart_minutes} min (counted as used)"
            if options.evict_after_minutes
            else "steering only, nobody moved (--evict-after 0)"
        )
    )
    print()
    if args.fixed_nodes:
        print("a fixed group: every setup provisions the same; the waits show the difference")
    else:
        print("\n".join(ratios(columns, FLEXGPU, NVIDIA)))
        for mine, theirs in STEERING_PAIRS:
            print("\n".join(ratios(columns, [mine], [theirs])))
    print(f"model run time {time.monotonic() - start:.0f} s")
    if args.packing:
        from bench import packing_churn  # a control plane: imported only when asked for

        print("\nreal scheduler, packing under churn: (c) flexgpu vs (b) NVIDIA DRA publication")
        packing_churn.main(["--publications", "flexgpu,nvidia-style"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
