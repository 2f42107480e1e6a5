"""Why large requests of a ``bench.packing_churn --record FILE`` run were not placed:

    python -m bench.packing_lost FILE [--publication flexgpu]

For every large request that no step placed, one line per step it waited: each GPU's memory
slices (``.`` free, ``#`` held, ``C`` a GPU being cleared for this request, ``c`` one cleared
for another), the free slices in total against what it needs, and whether its placement was
free somewhere (then only the scheduler's retry back-off kept it waiting). Then whether GPU
clearing chose a GPU for it, whether that GPU emptied before the trace ended, and which later
claim of the same kind took it. Requests in
the replay never give up: a request not placed by the last step is lost to the trace's end.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.packing_churn import KINDS

GPUS = 8
SLICES = 8
# Memory slices each request kind takes, and the slices its placements may start at (NVIDIA's
# MIG placement table for the H100, from its MIG user guide).
SIZES = {
    "1g10gb": 1,
    "1g10gb-me": 1,
    "1g20gb": 2,
    "2g20gb": 2,
    "3g40gb": 4,
    "4g40gb": 4,
    "7g80gb": 8,
}
STARTS = {
    "1g.10gb": range(7),
    "1g.20gb": range(0, 8, 2),
    "2g.20gb": range(0, 6, 2),
    "3g.40gb": (0, 4),
    "4g.40gb": (0,),
    "7g.80gb": (0,),
    "whole": (0,),
}
MIG = re.compile(r"gpu-(\d+)-mig-([a-z0-9-]+)-(\d+)$")
WHOLE = re.compile(r"gpu-(\d+)$")


def need(kind: str) -> int:
    return SLICES if kind == "whole" else SIZES[kind.replace(".", "")]


def held_slices(device: str) -> tuple[int, set[int]]:
    """The GPU index and memory slices a device name of flexgpu's publication stands for."""
    whole = WHOLE.match(device)
    if whole:
        return int(whole.group(1)), set(range(SLICES))
    mig = MIG.match(device)
    if not mig:
        raise ValueError(f"device {device!r}: not a flexgpu GPU or partition name")
    start, size = int(mig.group(3)), SIZES[mig.group(2)]
    return int(mig.group(1)), set(range(start, start + size))


@dataclass
class StepView:
    step: int
    used: list[set[int]]  # per GPU
    cleared: dict[int, str]  # GPU index -> claim it is cleared for
    holders: dict[str, list[int]]  # claim -> GPU indexes


def views(lines: Sequence[dict[str, Any]], publication: str) -> list[StepView]:
    out = []
    for line in lines:
        used: list[set[int]] = [set() for _ in range(GPUS)]
        holders: dict[str, list[int]] = {}
        for claim, devices in line["allocations"].get(publication, {}).items():
            for device in devices:
                gpu, slices = held_slices(device)
                used[gpu] |= slices
                holders.setdefault(claim, []).append(gpu)
        cleared: dict[int, str] = {}
        for pool, device, claim in line["clearing"]:
            # the hollow nodes (pools) of a publication are named after it
            if pool.startswith(f"{publication}-"):
                cleared[held_slices(device)[0]] = claim.split("/")[-1]
        out.append(StepView(line["step"], used, cleared, holders))
    return out


def fits(kind: str, used: set[int]) -> bool:
    size = need(kind)
    return any(not (set(range(s, s + size)) & used) for s in STARTS[kind])


def explain(lines: Sequence[dict[str, Any]], publication: str) -> list[str]:
    header, steps = lines[0], views(lines[1:], publication)
    placed_ever = {claim for v in steps for claim in v.holders}
    out: list[str] = []
    for ident, kind, arrives, lifetime in header["requests"]:
        name = f"r{ident}"
        if not KINDS[kind][1] or name in placed_ever:
            continue
        out.append(f"r{ident} {kind} arrived step {arrives + 1} (lifetime {lifetime}):")
        chosen: set[int] = set()
        for v in steps[arrives:]:
            row = []
            for g in range(GPUS):
                mark = "C" if v.cleared.get(g) == name else ("c" if g in v.cleared else "")
                cells = "".join("#" if s in v.used[g] else "." for s in range(SLICES))
                row.append(cells + mark)
            free = sum(SLICES - len(u) for u in v.used)
            room = [g for g in range(GPUS) if fits(kind, v.used[g])]
            chosen |= {g for g, c in v.cleared.items() if c == name}
            note = f"placement free on GPU {room}" if room else "no GPU has its placement free"
            out.append(
                f"  step {v.step + 1:2d}: {' '.join(f'{r:9s}' for r in row)} "
                f"free {free:2d}/{need(kind)} slices; {note}"
            )
        last = steps[-1]
        if not chosen:
            out.append("  clearing: no GPU chosen for it")
        kinds = {f"r{i}": (k, a) for i, k, a, _ in header["requests"]}
        for g in sorted(chosen):
            empty = [v.step + 1 for v in steps if v.step >= arrives and not v.used[g]]
            out.append(
                f"  clearing chose GPU {g}; "
                + (f"empty at step {empty[0]}" if empty else "never empty at a settled step")
                + f" (holders at the end: {sorted(c for c, gs in last.holders.items() if g in gs)})"
            )
            # A GPU that empties between two settled steps can be taken at once by another
            # claim asking the same device as the waiting one (that device is not tainted).
            for before, now in zip(steps[arrives:], steps[arrives + 1 :], strict=False):
                if before.cleared.get(g) != name:
                    continue
                for claim in sorted(set(now.holders) - set(before.holders)):
                    if g in now.holders[claim] and kinds[claim][0] == kind:
                        out.append(
                            f"  step {now.step + 1}: {claim} ({kind}, arrived step "
                            f"{kinds[claim][1] + 1}) took GPU {g}"
                        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--publication", default="flexgpu")
    args = parser.parse_args(argv)
    lines = [json.loads(t) for t in args.record.read_text().splitlines() if t.strip()]
    print("\n".join(explain(lines, args.publication)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
