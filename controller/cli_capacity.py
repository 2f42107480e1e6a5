"""``flexgpu capacity``: free and total devices per type, product and MIG profile, and the
memory and compute left on shared GPUs; ``-o wide`` per node.

MIG rows are listed under the GPUs of their product, indented: a MIG partition is carved from
a GPU, so it and the whole GPU (and, with dynamic MIG, other placements on the same GPU) are
alternatives that exclude each other. Their FREE counts say what could be allocated next, one
at a time; they do not add up.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, Final

from flexgpu.controller.cli_cluster import read_cluster
from flexgpu.controller.cli_options import ExitCode, add_cluster_options, connect, emit
from flexgpu.driver.allocation import CapacityRow, capacity_summary
from flexgpu.driver.allocation.describe import format_quantity
from flexgpu.driver.allocation.model import ResourceSlice

MIG_TYPE: Final = "mig"
MIG_NOTE: Final = (
    "└ mig rows are MIG partitions carved from the GPUs of the product above them: a partition "
    "overlaps its GPU (and other placements on that GPU), so partitions and GPUs are "
    "alternatives and the FREE counts do not add up."
)


def _shareable_json(row: CapacityRow) -> dict[str, Any]:
    return {
        name: {"free": format_quantity(left), "total": format_quantity(total)}
        for name, (left, total) in sorted(row.shareable.items())
    }


def _share_text(row: CapacityRow) -> str:
    def one(name: str, left: Fraction, total: Fraction) -> str:
        unit = "%" if name == "compute" else ""
        return f"{name} {format_quantity(left)}{unit}/{format_quantity(total)}{unit}"

    return ", ".join(one(n, *v) for n, v in sorted(row.shareable.items())) or "-"


def ordered(rows: Sequence[CapacityRow]) -> list[CapacityRow]:
    """Per product: its GPU rows (whole, shared), then its MIG rows by profile."""
    return sorted(rows, key=lambda r: (r.product, r.type == MIG_TYPE, r.type, r.profile))


def capacity_table(rows: Sequence[tuple[str, CapacityRow]], *, wide: bool = False) -> str:
    """``rows``: (node or "", row), in display order."""
    header: tuple[str, ...] = (
        "TYPE",
        "PRODUCT",
        "PROFILE",
        "FREE",
        "TOTAL",
        "SHAREABLE FREE/TOTAL",
    )
    if wide:
        header = ("NODE", *header)
    lines: list[tuple[str, ...]] = [header]
    for node, r in rows:
        kind = f"  └ {r.type}" if r.type == MIG_TYPE else r.type
        cells = (kind, r.product or "-", r.profile or "-", str(r.free), str(r.total))
        lines.append(((node,) if wide else ()) + cells + (_share_text(r),))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line[:-1], widths, strict=True))
        + "  "
        + line[-1]
        for line in lines
    )


def _row_json(row: CapacityRow, node: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {} if node is None else {"node": node}
    body |= {
        "type": row.type,
        "product": row.product,
        "profile": row.profile,
        "total": row.total,
        "free": row.free,
        "shareable": _shareable_json(row),
    }
    if row.type == MIG_TYPE:
        # Which GPUs the partitions are carved from; they overlap those GPUs' own rows.
        body["partitionOf"] = {"type": "gpu", "product": row.product}
    return body


def _per_node(
    slices: Sequence[ResourceSlice], claims: Sequence[Any]
) -> list[tuple[str, CapacityRow]]:
    out: list[tuple[str, CapacityRow]] = []
    for pool in sorted({s.pool for s in slices}):
        mine = [s for s in slices if s.pool == pool]
        node = next((s.node_name for s in mine if s.node_name), "") or pool
        out += [(node, r) for r in ordered(capacity_summary(mine, claims))]
    return out


def run_capacity(args: argparse.Namespace) -> int:
    connection = connect(args)
    read = read_cluster(connection, namespace=connection.namespace)
    snapshot = read.snapshot
    slices = list(snapshot.slices.values())
    claims = [c.model for c in snapshot.claims.values()]
    wide = args.output == "wide"
    if wide:
        rows = _per_node(slices, claims)
    else:
        rows = [("", r) for r in ordered(capacity_summary(slices, claims))]
    if args.output in ("json", "yaml"):
        emit([_row_json(r, None) for _, r in rows], args.output)
        return ExitCode.OK
    if not rows:
        print("No flexgpu devices are published in this cluster.")
        return ExitCode.OK
    print(capacity_table(rows, wide=wide))
    if any(r.type == MIG_TYPE for _, r in rows):
        print()
        print(MIG_NOTE)
    for note in read.notes:
        print(f"Note: {note}")
    return ExitCode.OK


def add_capacity(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "capacity",
        help="free and total GPUs, MIG partitions and shareable capacity, cluster-wide",
        description="Free devices per type, product and MIG profile, and the memory and "
        "compute left on shared GPUs, from the published ResourceSlices and allocated claims "
        "(-o wide: per node). MIG rows are indented under the GPUs they are carved from.",
    )
    add_cluster_options(parser, outputs=("json", "yaml", "wide"), all_namespaces=False)
    parser.set_defaults(handler=run_capacity)
