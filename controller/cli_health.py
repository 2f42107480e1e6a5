"""``flexgpu health``: every tainted flexgpu device in the cluster, and why.

The plugin publishes a GPU's faults as device taints (docs/admin.md, "GPU health"); this
reads them back from the ResourceSlices, one row per device and taint, faults before
reconfiguration. On releases without device taints a faulty GPU is withdrawn instead and
appears here as nothing: the plugin's log and the kubelet's health stream name it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from flexgpu.controller.cli_cluster import list_slices
from flexgpu.controller.cli_options import ExitCode, add_cluster_options, connect, emit
from flexgpu.driver.allocation.model import ResourceSlice, parse_slice
from flexgpu.driver.device_health import describe_taint
from flexgpu.driver.names import DRIVER_NAME


@dataclass(frozen=True)
class TaintRow:
    node: str
    device: str
    key: str
    value: str
    effect: str
    reason: str


def taint_rows(slices: Sequence[ResourceSlice]) -> list[TaintRow]:
    """One row per taint on a flexgpu device, by node and device name."""
    rows = [
        TaintRow(
            node=s.node_name or s.pool,
            device=d.name,
            key=t.key,
            value=t.value,
            effect=t.effect,
            reason=describe_taint(t.key, t.value),
        )
        for s in slices
        if s.driver == DRIVER_NAME
        for d in s.devices
        for t in d.taints
    ]
    return sorted(rows, key=lambda r: (r.node, _device_order(r.device), r.key))


def _device_order(name: str) -> tuple[int, str]:
    # gpu-2 before gpu-10: the number after "gpu-" first.
    head = name.removeprefix("gpu-").split("-", 1)[0]
    return (int(head) if head.isdigit() else 1 << 30, name)


def taint_table(rows: Sequence[TaintRow]) -> str:
    lines = [("NODE", "DEVICE", "EFFECT", "TAINT", "REASON")]
    lines += [
        (r.node, r.device, r.effect, f"{r.key}={r.value}" if r.value else r.key, r.reason)
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(line[:4], widths, strict=True)) + "  " + line[4]
        for line in lines
    )


def run_health(args: argparse.Namespace) -> int:
    rows = taint_rows([parse_slice(s) for s in list_slices(connect(args))])
    if args.output in ("json", "yaml"):
        emit([asdict(r) for r in rows], args.output)
        return ExitCode.OK
    if not rows:
        print("No flexgpu device is tainted.")
        return ExitCode.OK
    print(taint_table(rows))
    return ExitCode.OK


def add_health(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "health",
        help="tainted GPUs and MIG devices, cluster-wide, and why",
        description="Every flexgpu device published with a taint: GPU faults (Xid errors, a "
        "lost GPU, NVML unavailable; effect None is informational, NoSchedule keeps new "
        "claims off) and GPUs waiting to be reconfigured by a GpuNodePolicy.",
    )
    add_cluster_options(parser, outputs=("json", "yaml"), namespace=False, all_namespaces=False)
    parser.set_defaults(handler=run_health)
