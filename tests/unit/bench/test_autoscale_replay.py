"""The autoscaling replay's model: the trace follows the day, the autoscaler launches only the
nodes the pending claims need (packed by the real allocator on template nodes), bills them from
launch, removes them once idle, and a fixed group serves at once."""

from __future__ import annotations

import pytest

from bench.autoscale_replay import (
    GROUP_POLICY,
    TOPOLOGY,
    Cluster,
    RunResult,
    device_classes,
    replay,
)
from bench.autoscale_trace import BY_NAME, Arrival, day_trace
from flexgpu.driver.allocation import parse_claim
from flexgpu.driver.node_template import NodeTemplate, render_node_template
from flexgpu.driver.topology import load_topology

BOOT = 6
IDLE = 10


@pytest.fixture(scope="module")
def template() -> NodeTemplate:
    return render_node_template(load_topology(TOPOLOGY), GROUP_POLICY)


def run(
    template: NodeTemplate, trace: list[Arrival], *, autoscale: bool, fixed: int = 0
) -> RunResult:
    objects = {name: parse_claim(kind.claim_body()) for name, kind in BY_NAME.items()}
    return replay(
        trace,
        Cluster(template, device_classes(), objects),
        autoscale=autoscale,
        fixed_nodes=fixed,
        boot_minutes=BOOT,
        idle_minutes=IDLE,
        max_nodes=10,
    )


def test_the_trace_is_seeded_and_busier_by_day() -> None:
    assert day_trace(3) == day_trace(3) != day_trace(4)
    trace = day_trace(3)
    night = sum(1 for a in trace if a.minute < 6 * 60)
    day = sum(1 for a in trace if 9 * 60 <= a.minute < 15 * 60)
    assert day > 3 * night


def test_a_pending_claim_brings_a_node_billed_from_launch_and_removed_when_idle(
    template: NodeTemplate,
) -> None:
    result = run(template, [Arrival(0, "train-4gpu-nvlink", 30)], autoscale=True)
    (claim,) = result.claims
    assert claim.started == BOOT  # waited for the node to boot
    assert result.peak_nodes == 1
    # Billed from launch: boot, the run, the idle time before removal (minute granularity).
    assert BOOT + 30 + IDLE <= result.node_minutes <= BOOT + 30 + IDLE + 1


def test_small_claims_arriving_together_are_packed_onto_one_new_node(
    template: NodeTemplate,
) -> None:
    # Two on-demand MIG GPUs hold 14 1g.10gb partitions; shares go to the shared GPUs.
    trace = [Arrival(0, "infer-mig-1g", 60) for _ in range(12)]
    trace += [Arrival(0, "infer-share-20gi", 60) for _ in range(6)]
    result = run(template, trace, autoscale=True)
    assert result.peak_nodes == 1
    assert all(c.started == BOOT for c in result.claims)


def test_claims_beyond_one_node_bring_as_many_nodes_as_they_need(
    template: NodeTemplate,
) -> None:
    # 4-GPU NVLink sets: 4 whole and 2 on-demand MIG GPUs usable whole, so one per node.
    trace = [Arrival(0, "train-4gpu-nvlink", 60) for _ in range(3)]
    result = run(template, trace, autoscale=True)
    assert result.peak_nodes == 3
    assert {c.node for c in result.claims} == {"gpu-node-0", "gpu-node-1", "gpu-node-2"}


def test_a_fixed_group_serves_at_once_and_bills_every_minute(
    template: NodeTemplate,
) -> None:
    result = run(template, [Arrival(5, "train-1gpu", 20)], autoscale=False, fixed=2)
    (claim,) = result.claims
    assert claim.started == 5
    assert result.node_minutes == 2 * result.horizon
