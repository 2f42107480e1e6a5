"""``flexgpu health`` reads the taints the plugin publishes back as rows that say why."""

from __future__ import annotations

import pytest

from flexgpu.controller import cli
from flexgpu.controller.cli_health import taint_rows, taint_table
from flexgpu.driver.allocation import parse_slice
from flexgpu.driver.device_health import Fault
from flexgpu.driver.resource_slice import slice_specs
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.xid import FaultClass, XidImpact
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices


def _published(devices: NodeDevices) -> list[object]:
    return [
        parse_slice({"metadata": {"name": f"node-a-{i}"}, "spec": spec})
        for i, spec in enumerate(slice_specs("node-a", devices.slice_devices(), 1))
    ]


def test_each_taint_of_the_published_slices_is_a_row_with_its_reason() -> None:
    devices = NodeDevices(SimulatedBackend.from_topology("hgx-h100-8", "node-a"))
    devices.set_health(
        {
            (2, None): [Fault(FaultClass.MEMORY, XidImpact.FATAL, "xid-48", "x", 0.0)],
            (0, None): [Fault(FaultClass.GPU_LOST, XidImpact.FATAL, "lost", "x", 0.0)],
        }
    )
    devices.set_taints({5: "reconfiguring"})
    devices.refresh()
    rows = taint_rows(_published(devices))  # type: ignore[arg-type]
    assert [(r.device, r.effect, r.reason) for r in rows] == [
        ("gpu-0", "NoSchedule", "GPU lost"),
        ("gpu-2", "NoSchedule", "memory error: Xid 48 (double-bit ECC error)"),
        ("gpu-5", "NoSchedule", "flexgpu.dev/reconfiguring=reconfiguring"),
    ]
    table = taint_table(rows).splitlines()
    assert table[0].split() == ["NODE", "DEVICE", "EFFECT", "TAINT", "REASON"]
    assert table[2].startswith("node-a  gpu-2   NoSchedule  gpu.flexgpu.dev/memory-error=xid-48")


def test_an_untainted_cluster_has_no_rows() -> None:
    devices = NodeDevices(SimulatedBackend.from_topology("l4-2-pcie", "node-a"))
    assert taint_rows(_published(devices)) == []  # type: ignore[arg-type]


def test_health_is_a_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["health", "--help"])
    assert done.value.code == 0
    assert "usage: flexgpu health" in capsys.readouterr().out
