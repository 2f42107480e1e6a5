"""Setup (d)'s steering in the replay: a steered node takes a claim that fits nowhere else at
once (steering never makes a claim wait), an opted-in inference claim is moved off a node
steered too long and starts again elsewhere after its restart cost, and a training Job's claim
is never moved."""

from __future__ import annotations

import pytest

from bench.autoscale_replay import Claim, Cluster, RunResult, replay
from bench.autoscale_trace import Arrival
from bench.side_by_side_setups import Setup, flexgpu_all_mig
from bench.steering_replay import NodeSteering, SteeringOptions


@pytest.fixture(scope="module")
def all_mig() -> Setup:
    return flexgpu_all_mig()


def run(setup: Setup, trace: list[Arrival], steering: NodeSteering | None) -> RunResult:
    assert setup.template is not None
    return replay(
        trace,
        Cluster(setup.template, setup.classes, setup.claims),
        autoscale=False,
        fixed_nodes=2,
        boot_minutes=6,
        idle_minutes=10,
        max_nodes=2,
        steering=steering,
    )


def starts(result: RunResult) -> list[int | None]:
    return [c.started for c in result.claims]


def test_a_claim_that_fits_only_on_the_steered_node_is_placed_at_once(all_mig: Setup) -> None:
    trace = [
        Arrival(0, "infer-mig-1g", 120),
        # gpu-node-1 is empty, so steered from minute 0; the first set of 4 fits on
        # gpu-node-0 beside the partition, the second only on the steered node.
        Arrival(1, "train-4gpu-nvlink", 60),
        Arrival(1, "train-4gpu-nvlink", 60),
    ]
    steering = NodeSteering(SteeringOptions(share=0.5, evict_after_minutes=None))
    steered = run(all_mig, trace, steering)
    assert starts(steered) == [0, 1, 1] == starts(run(all_mig, trace, None))
    assert steering.started >= 1 and steering.released == 1
    assert [c.node for c in steered.claims] == ["gpu-node-0", "gpu-node-0", "gpu-node-1"]


def _holder_then_room(kind: str) -> list[Arrival]:
    """gpu-node-0 is full until minute 5, then has room; gpu-node-1 holds one ``kind``."""
    return [
        Arrival(0, "train-4gpu-nvlink", 5),
        Arrival(0, "train-4gpu-nvlink", 300),
        Arrival(0, kind, 100),
    ]


def test_an_opted_in_inference_claim_moves_off_a_node_steered_too_long(all_mig: Setup) -> None:
    steering = NodeSteering(SteeringOptions(share=0.5, evict_after_minutes=10, restart_minutes=5))
    result = run(all_mig, _holder_then_room("infer-mig-1g"), steering)
    moved = result.claims[2]
    assert steering.evictions == 1
    # Steered from minute 5 (when gpu-node-0 had room for it), moved 10 minutes later.
    assert moved.node == "gpu-node-0" and steering.allocated_at[moved.index] == 15
    assert moved.started == 0 and moved.ends_at == 0 + 100 + 5


def test_a_training_jobs_claim_is_never_moved(all_mig: Setup) -> None:
    steering = NodeSteering(SteeringOptions(share=0.5, evict_after_minutes=10))
    result = run(all_mig, _holder_then_room("train-1gpu"), steering)
    assert steering.evictions == 0
    assert result.claims[2].node == "gpu-node-1" and result.claims[2].extra_minutes == 0


@pytest.mark.parametrize("evict_after", [10, None])
def test_the_controller_is_told_which_holders_may_move_only_where_eviction_is_on(
    all_mig: Setup, evict_after: int | None
) -> None:
    # Ranking puts nodes of movable holders first; with eviction off nobody is movable.
    seen: dict[str, bool] = {}

    class Recording(NodeSteering):
        def step(self, cluster: Cluster, running: dict[int, Claim], minute: int) -> None:
            super().step(cluster, running, minute)
            seen.update({h.claim: h.movable for n in self.group for h in n.holders})

    steering = Recording(SteeringOptions(share=0.5, evict_after_minutes=evict_after))
    run(all_mig, [Arrival(0, "infer-mig-1g", 30), Arrival(0, "train-1gpu", 30)], steering)
    assert seen == {"replay/0": evict_after is not None, "replay/1": False}
