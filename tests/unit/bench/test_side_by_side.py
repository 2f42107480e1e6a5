"""The side-by-side benchmark's pieces: the table never shows a figure for a setup that was not
run, ratios are computed between run setups only, each setup's node is what its docs say
(the device plugin's fixed layout, NVIDIA's node-wide dynamic MIG) as the allocator sees it,
and the steering setups run on their base group and count what they move."""

from __future__ import annotations

import argparse

import pytest

from bench.autoscale_replay import Cluster, SimNode, add_choices, state_of
from bench.side_by_side import run_setup
from bench.side_by_side_setups import (
    Setup,
    device_plugin,
    flexgpu_all_mig,
    flexgpu_today,
    nvidia_dra,
    setups,
    steering,
)
from bench.side_by_side_table import Column, Figures, ratios, table
from bench.steering_replay import SteeringOptions


def figures(provisioned: float, used: float = 100.0, large: int = 5) -> Figures:
    return Figures(provisioned, used, large, 6, 10, 10, (0.0, 1.0, 9.0), (2.0,))


def test_table_shows_figures_and_a_reason_for_a_setup_not_run() -> None:
    columns = [
        Column("a", "one", figures(400.0)),
        Column("d", "two", None, "its module is not part of this tree"),
    ]
    lines = table(columns)
    assert "400.0" in lines[1] and "not run" in lines[1]
    assert "25.0%" in next(line for line in lines if line.startswith("used / provisioned"))
    # Nearest rank: the p50 of three waits is the second.
    assert "1 / 9 / 9" in next(line for line in lines if line.startswith("small wait"))
    assert "5 of 6" in next(line for line in lines if line.startswith("large claims"))
    assert lines[-1] == "(d) not run: its module is not part of this tree"
    # The column of the setup not run holds no number in any row.
    for line in lines[1:-1]:
        assert line.rstrip().endswith("not run")


def test_ratios_compare_run_setups_only() -> None:
    columns = [
        Column("a", "theirs", figures(400.0)),
        Column("c", "mine", figures(200.0)),
        Column("d", "not run", None, "reason"),
    ]
    lines = ratios(columns, ["c", "d"], ["a"])
    assert lines == [
        "(c) vs (a): GPU-hours provisioned x0.50, used/provisioned x2.00, "
        "large claims placed 5 vs 5"
    ]


def _node(setup: Setup) -> tuple[Cluster, SimNode]:
    assert setup.template is not None
    cluster = Cluster(setup.template, setup.classes, setup.claims)
    return cluster, cluster.launch(0, 0)


def _fill(cluster: Cluster, node: SimNode, kind: str) -> int:
    """How many claims of ``kind`` one empty node takes."""
    state = state_of([])
    placed = 0
    while (devices := cluster.fit(kind, node, state)) is not None:
        add_choices(state, devices)
        placed += 1
    return placed


@pytest.fixture(scope="module")
def plugin() -> Setup:
    return device_plugin()


@pytest.fixture(scope="module")
def nvidia() -> Setup:
    return nvidia_dra()


def test_device_plugin_node_has_its_fixed_layout(plugin: Setup) -> None:
    cluster, node = _node(plugin)
    # all-balanced on GPUs 6-7: one 3g.40gb and two 1g.10gb each, made ahead, never re-cut.
    assert _fill(cluster, node, "infer-mig-3g") == 2
    assert _fill(cluster, node, "infer-mig-1g") == 4
    # Time-slicing: 4 replicas on each of GPUs 4-5; whole GPUs 0-3 only.
    assert _fill(cluster, node, "infer-share-20gi") == 8
    assert _fill(cluster, node, "train-1gpu") == 4
    names = [d.name for s in node.slices for d in s.devices]
    assert {"gpu-6-mig-3g.40gb-4", "gpu-6-mig-2g.20gb-2", "gpu-6-mig-1g.10gb-1"} <= set(names)


def test_nvidia_dra_node_partitions_every_gpu_on_demand(nvidia: Setup) -> None:
    cluster, node = _node(nvidia)
    # Node-wide DynamicMIG: every GPU can be cut, counters keep partitions from overlapping.
    assert _fill(cluster, node, "infer-mig-3g") == 16
    assert _fill(cluster, node, "infer-mig-1g") == 56
    # No consumable capacity: a 20 GiB claim takes a 1g.20gb partition, 4 per GPU.
    assert _fill(cluster, node, "infer-share-20gi") == 32
    assert _fill(cluster, node, "train-1gpu") == 8


def test_flexgpu_nodes_as_documented() -> None:
    cluster, node = _node(flexgpu_today())
    # 20 GiB shares of an H100 reporting 81,559 MiB: 3 per shared GPU, 2 shared GPUs.
    assert _fill(cluster, node, "infer-share-20gi") == 6
    # Whole GPUs 0-3, and the on-demand MIG GPUs 6-7 also as whole GPUs.
    assert _fill(cluster, node, "train-1gpu") == 6
    cluster, node = _node(flexgpu_all_mig())
    assert _fill(cluster, node, "infer-share-20gi") == 32
    assert _fill(cluster, node, "infer-mig-1g") == 56


def test_steering_setups_are_their_base_group_with_steering() -> None:
    keys = [(s.key, s.steering is not None) for s in setups()]
    assert keys == [
        ("a", False),
        ("b", False),
        ("c", False),
        ("c2", False),
        ("d", True),
        ("d2", True),
    ]
    base = flexgpu_all_mig()
    d2 = steering(base, SteeringOptions(evict_after_minutes=None))
    assert (d2.key, d2.template, d2.claims) == ("d2", base.template, base.claims)
    assert d2.steering is not None and d2.steering.evict_after_minutes is None


def test_the_steering_setup_runs_the_day_and_counts_evictions() -> None:
    args = argparse.Namespace(
        seed=7, days=1, fixed_nodes=0, boot_minutes=6, idle_minutes=10, max_nodes=40
    )
    column = run_setup(steering(flexgpu_all_mig()), args)
    assert column.figures is not None and column.figures.evictions is not None
    f = column.figures
    assert (f.large_placed, f.small_placed) == (f.large_total, f.small_total)
    evictions = next(line for line in table([column]) if line.startswith("evictions"))
    assert evictions.split()[-1] == str(f.evictions)
