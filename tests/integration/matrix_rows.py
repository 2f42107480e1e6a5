"""The combination matrix's rows: its dimensions, which combinations exist, and the all-pairs
rows (allpairspy, completed greedily) that test_combination_matrix runs; the dimensions are
described there."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from allpairspy import AllPairs

KINDS = ("whole", "mig", "static-mig", "fraction")
CONFIGS = (
    "none",
    "GpuConfig-TS",
    "GpuConfig-MPS",
    "MigDeviceConfig-TS",
    "MigConfig-MPS",
    "GpuConfig-burst",
    "nvidia",
)
TENANCY = ("one", "two")
ARRIVAL = ("one", "burst")
BINDING = ("on", "off")
EVENTS = ("none", "restart", "delete-before-binding", "realloc-after-refusal", "driver-upgrade")
TAINTS = ("none", "gpu")
DIMENSIONS = (KINDS, CONFIGS, TENANCY, ARRIVAL, BINDING, EVENTS, TAINTS)
NAMES = ("kind", "config", "tenancy", "arrival", "binding", "event", "taint")


@dataclass(frozen=True)
class Row:
    kind: str
    config: str
    tenancy: str
    arrival: str
    binding: str
    event: str
    taint: str

    @property
    def values(self) -> tuple[str, ...]:
        return tuple(getattr(self, n) for n in NAMES)

    @property
    def id(self) -> str:
        return "-".join(self.values)


def _valid(values: list[str]) -> bool:
    """Whether a (partial) row names a combination that exists."""
    row = dict(zip(NAMES, values, strict=False))
    kind, config, event = row.get("kind"), row.get("config"), row.get("event")
    if kind == "whole" and config in ("MigDeviceConfig-TS", "MigConfig-MPS"):
        return False  # a MIG config on a whole GPU: refused (tested in test_opaque_config)
    if kind in ("mig", "static-mig", "fraction") and config in ("GpuConfig-TS", "GpuConfig-MPS"):
        return False  # a GpuConfig on a MIG device or a fraction: refused likewise
    if kind == "fraction" and config in ("MigDeviceConfig-TS", "MigConfig-MPS"):
        return False
    if config == "GpuConfig-burst" and kind not in (None, "fraction"):
        return False  # the share block on a whole GPU: refused (tested in test_share_config)
    if event == "realloc-after-refusal":
        # Something must be refusable: a partition made before binding (on-demand MIG with
        # binding conditions), or a free shared GPU another namespace takes (two tenants).
        if kind not in (None, "mig", "fraction"):
            return False
        if row.get("binding") == "off":
            return False
        if kind == "fraction" and row.get("tenancy") == "one":
            return False
    return True


def _pairs(values: tuple[str, ...]) -> set[tuple[int, str, int, str]]:
    return {(i, a, j, b) for (i, a), (j, b) in itertools.combinations(enumerate(values), 2)}


def _valid_rows() -> list[tuple[str, ...]]:
    return [v for v in itertools.product(*DIMENSIONS) if _valid(list(v))]


def valid_pairs() -> set[tuple[int, str, int, str]]:
    """Every pair of values some valid row holds."""
    return set().union(*(_pairs(v) for v in _valid_rows()))


def matrix() -> list[Row]:
    """allpairspy's rows, completed: with a filter it may leave a pair out, so each pair
    still missing gets the valid row that covers it and the most other missing pairs."""
    rows = [tuple(r) for r in AllPairs(list(DIMENSIONS), filter_func=_valid)]
    missing = valid_pairs() - set().union(*(_pairs(r) for r in rows))
    candidates = _valid_rows()
    while missing:
        pair = min(missing)
        best = max(
            (v for v in candidates if pair in _pairs(v)),
            key=lambda v: (len(_pairs(v) & missing), v),
        )
        rows.append(best)
        missing -= _pairs(best)
    # Rows that need the same plugin run next to each other: fewer restarts.
    return sorted(
        (Row(*r) for r in rows),
        key=lambda r: (r.binding, r.event == "realloc-after-refusal", r.kind, r.id),
    )


def coverage(rows: list[Row]) -> tuple[int, int]:
    """(pairs covered, valid pairs)."""
    valid = valid_pairs()
    covered = set().union(*(_pairs(r.values) for r in rows))
    return len(covered & valid), len(valid)
