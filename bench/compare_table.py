"""The side-by-side table: one row per figure with flexgpu's value, the reference driver's,
their ratio (flexgpu / reference) and, where there is one, the target and whether it is met."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile; NaN for no values (every call of that kind failed)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]


@dataclass(frozen=True)
class Target:
    text: str
    met: Callable[[float, float, float], bool]  # (flexgpu, reference, ratio) -> met


def ratio_at_most(limit: float) -> Target:
    return Target(f"ratio <= {limit:g}", lambda _f, _r, ratio: ratio <= limit)


def ratio_at_least(limit: float) -> Target:
    return Target(f"ratio >= {limit:g}", lambda _f, _r, ratio: ratio >= limit)


def flexgpu_at_most(limit: float, unit: str = "") -> Target:
    return Target(f"flexgpu <= {limit:g}{unit}", lambda flex, _r, _ratio: flex <= limit)


@dataclass(frozen=True)
class Row:
    figure: str
    flexgpu: float
    reference: float
    digits: int = 1
    target: Target | None = None

    @property
    def ratio(self) -> float:
        if math.isnan(self.flexgpu) or math.isnan(self.reference):
            return math.nan
        if self.reference == 0:
            return 1.0 if self.flexgpu == 0 else math.inf
        return self.flexgpu / self.reference

    def verdict(self) -> str:
        if self.target is None:
            return ""
        values = (self.flexgpu, self.reference, self.ratio)
        if any(math.isnan(v) for v in values):
            return "n/a"
        return "pass" if self.target.met(*values) else "FAIL"


def _number(value: float, digits: int) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def render(rows: Sequence[Row], reference: str = "example") -> str:
    """A Markdown table, readable as printed and pasteable into the docs; ``reference`` heads
    the competitor's column."""
    header = ("figure", "flexgpu", reference, "ratio", "target", "")
    lines = [header]
    for row in rows:
        lines.append(
            (
                row.figure,
                _number(row.flexgpu, row.digits),
                _number(row.reference, row.digits),
                "n/a" if math.isnan(row.ratio) else _number(row.ratio, 3) + "x",
                row.target.text if row.target else "",
                row.verdict(),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        cells = [
            cell.ljust(w) if i == 0 or i >= 4 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        ]
        out.append("| " + " | ".join(cells) + " |")
        if n == 0:
            out.append(
                "|"
                + "|".join(
                    ("-" * (w + 1) + ":" if 0 < i < 4 else "-" * (w + 2))
                    for i, w in enumerate(widths)
                )
                + "|"
            )
    return "\n".join(out)
