"""The table ``bench.side_by_side`` prints: one column per setup, one row per figure, then each
flexgpu setup's ratios against the two NVIDIA ones. A setup that was not run keeps its column
with the reason, never a figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from bench.compare_table import percentile


@dataclass(frozen=True)
class Figures:
    """One setup's run. Waits are minutes from pending to running of the claims placed."""

    provisioned_gpu_hours: float
    used_gpu_hours: float
    large_placed: int
    large_total: int
    small_placed: int
    small_total: int
    small_waits: tuple[float, ...]
    large_waits: tuple[float, ...]
    evictions: int | None = None  # None: the setup moves nobody

    @property
    def used_share(self) -> float:
        if not self.provisioned_gpu_hours:
            return math.nan
        return self.used_gpu_hours / self.provisioned_gpu_hours


@dataclass(frozen=True)
class Column:
    key: str  # "a", "b", ...
    label: str
    figures: Figures | None
    not_run: str = ""


# A setup without steering evicts nobody: nodes are removed only when empty, nothing preempts,
# and no layout is re-cut under running pods. The row says so instead of printing a count.
NO_EVICTIONS = "none modelled"
WIDTH = 26  # the longest label, "(a) NVIDIA device plugin", and two spaces


def _waits(values: Sequence[float]) -> str:
    if not values:
        return "-"
    p50, p95 = percentile(values, 50), percentile(values, 95)
    return f"{p50:.0f} / {p95:.0f} / {max(values):.0f}"


def _cells(figures: Figures) -> list[str]:
    return [
        f"{figures.provisioned_gpu_hours:.1f}",
        f"{figures.used_gpu_hours:.1f}",
        f"{figures.used_share:.1%}",
        f"{figures.large_placed} of {figures.large_total}",
        f"{figures.small_placed} of {figures.small_total}",
        _waits(figures.small_waits),
        _waits(figures.large_waits),
        NO_EVICTIONS if figures.evictions is None else str(figures.evictions),
    ]


ROWS = (
    "GPU-hours provisioned",
    "GPU-hours used",
    "used / provisioned",
    "large claims placed",
    "small claims placed",
    "small wait p50/p95/max",
    "large wait p50/p95/max",
    "evictions",
)


def table(columns: Sequence[Column]) -> list[str]:
    head = f"{'':24s}" + "".join(f"({c.key}) {c.label}"[: WIDTH - 2].rjust(WIDTH) for c in columns)
    lines = [head]
    cells = [_cells(c.figures) if c.figures else ["not run"] * len(ROWS) for c in columns]
    for row, name in enumerate(ROWS):
        lines.append(f"{name:24s}" + "".join(col[row].rjust(WIDTH) for col in cells))
    for column in columns:
        if column.figures is None:
            lines.append(f"({column.key}) not run: {column.not_run}")
    return lines


def ratios(columns: Sequence[Column], mine: Sequence[str], theirs: Sequence[str]) -> list[str]:
    """For each run setup in ``mine`` against each run setup in ``theirs``: GPU-hours
    provisioned (below 1: fewer GPUs for the same work) and used/provisioned (above 1: a
    larger share of what is paid for does work)."""
    by_key = {c.key: c for c in columns}
    lines = []
    for m in mine:
        mf = by_key[m].figures
        if mf is None:
            continue
        for t in theirs:
            tf = by_key[t].figures
            if tf is None:
                continue
            provisioned = mf.provisioned_gpu_hours / tf.provisioned_gpu_hours
            lines.append(
                f"({m}) vs ({t}): GPU-hours provisioned x{provisioned:.2f}, "
                f"used/provisioned x{mf.used_share / tf.used_share:.2f}, "
                f"large claims placed {mf.large_placed} vs {tf.large_placed}"
            )
    return lines
