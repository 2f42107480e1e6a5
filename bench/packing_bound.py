"""How many large requests of a ``bench.packing_churn`` trace any placement could have placed:
the same trace (same seed, same draw) replayed offline, without a scheduler, three ways:

    python -m bench.packing_bound [--seeds 7,11,3,5] [--steps 40] [--publication flexgpu]

- ``first fit``: each step, the waiting requests oldest first, each on the first device of
  the publication's slice order whose memory slices are free (what kube-scheduler does for a
  one-device claim; its retry back-off and queue order are not modelled, so the real replay
  differs by a request or two);
- ``repacked``: as if every partition could be moved at every step (no real GPU can): a
  request is placed when the partitions alive then and it fit on the GPUs in some
  arrangement of NVIDIA's placements; oldest first;
- ``repacked, large first``: the same, large requests before small ones.

A large request that even the repacked replays leave unplaced is lost to the load, not to
placement: no publication order or choice of GPU to clear could have placed it without
holding back other requests.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from bench.packing_churn import KINDS, Request, trace
from bench.packing_lost import GPUS, SLICES, STARTS, need
from bench.scale_publications import inventory, node_specs, scratch

Order = list[tuple[str, int, int]]  # (kind, GPU, first memory slice) in slice order


def publication_order(publication: str) -> Order:
    inv = inventory("n", scratch(), dynamic=frozenset(range(GPUS)), shared=frozenset())
    order: Order = []
    for spec in node_specs(publication, "n", inv):
        for device in spec.get("devices", []):
            attrs = device["attributes"]
            if attrs["type"]["string"] == "gpu":
                order.append(("whole", int(attrs["index"]["int"]), 0))
            else:
                kind = str(attrs["profile"]["string"])
                order.append(
                    (kind, int(attrs["parentIndex"]["int"]), attrs["placementStart"]["int"])
                )
    return order


def _mask(kind: str, start: int) -> int:
    return ((1 << need(kind)) - 1) << start


def packable(kinds: Sequence[str]) -> bool:
    """Whether partitions of these kinds fit on the GPUs together in some arrangement."""
    ordered = sorted(kinds, key=lambda k: -need(k))
    if sum(need(k) for k in ordered) > GPUS * SLICES:
        return False
    failed: set[tuple[int, tuple[int, ...]]] = set()

    def place(i: int, gpus: tuple[int, ...]) -> bool:
        if i == len(ordered):
            return True
        if (i, gpus) in failed:
            return False
        kind = ordered[i]
        for g in sorted(set(range(GPUS)), key=lambda g: gpus[g]):
            if g and gpus[g] == gpus[g - 1]:
                continue  # GPUs in the same state: trying one is enough
            for start in STARTS[kind]:
                m = _mask(kind, start)
                if not gpus[g] & m:
                    after = tuple(sorted((*gpus[:g], gpus[g] | m, *gpus[g + 1 :])))
                    if place(i + 1, after):
                        return True
        failed.add((i, gpus))
        return False

    return place(0, (0,) * GPUS)


Placer = Callable[[list[Request], dict[int, int], int], None]


def _alive(placed: dict[int, int], lifetimes: dict[int, int], now: int) -> set[int]:
    return {i for i, at in placed.items() if at + lifetimes[i] > now}


def first_fit(order: Order, lifetimes: dict[int, int]) -> Placer:
    used = [0] * GPUS
    holds: dict[int, tuple[int, int]] = {}

    def step(waiting: list[Request], placed: dict[int, int], now: int) -> None:
        for ident in [i for i in holds if i not in _alive(placed, lifetimes, now)]:
            g, m = holds.pop(ident)
            used[g] &= ~m
        for r in waiting:
            for kind, g, start in order:
                if kind == r.kind and not used[g] & _mask(kind, start):
                    used[g] |= _mask(kind, start)
                    holds[r.ident] = (g, _mask(kind, start))
                    placed[r.ident] = now
                    break

    return step


def repacked(kinds: dict[int, str], lifetimes: dict[int, int]) -> Placer:
    def step(waiting: list[Request], placed: dict[int, int], now: int) -> None:
        alive = [kinds[i] for i in _alive(placed, lifetimes, now)]
        for r in waiting:
            if packable([*alive, r.kind]):
                alive.append(r.kind)
                placed[r.ident] = now

    return step


def run(requests: list[Request], steps: int, placer: Placer, large_first: bool) -> dict[int, int]:
    placed: dict[int, int] = {}
    for now in range(steps):
        waiting = [r for r in requests if r.arrives <= now and r.ident not in placed]
        if large_first:
            waiting.sort(key=lambda r: not KINDS[r.kind][1])
        placer(waiting, placed, now)
    return placed


def summary(requests: Sequence[Request], placed: dict[int, int]) -> str:
    parts = []
    for large in (True, False):
        mine = [r for r in requests if KINDS[r.kind][1] == large]
        waits = [placed[r.ident] - r.arrives for r in mine if r.ident in placed]
        mean = sum(waits) / len(waits) if waits else 0.0
        parts.append(f"{'large' if large else 'small'} {len(waits)}/{len(mine)} wait {mean:.2f}")
    return ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[7, 11, 3, 5]
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--arrivals-per-gpu", type=float, default=0.3)
    parser.add_argument("--publication", default="flexgpu")
    args = parser.parse_args(argv)
    order = publication_order(args.publication)
    for seed in args.seeds:
        requests = trace(args.steps, args.arrivals_per_gpu, GPUS, seed)
        lifetimes = {r.ident: r.lifetime for r in requests}
        kinds = {r.ident: r.kind for r in requests}
        for name, placer, large_first in (
            ("first fit", first_fit(order, lifetimes), False),
            ("repacked", repacked(kinds, lifetimes), False),
            ("repacked, large first", repacked(kinds, lifetimes), True),
        ):
            placed = run(requests, args.steps, placer, large_first)
            print(f"seed {seed:3d}  {name:22s} {summary(requests, placed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
