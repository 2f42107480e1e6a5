"""Node steering's choice: the node that will be empty soonest is steered first, only when
the rest of the group has room for what it holds, never past the bound, never a node more
than half full; and a claim that fits only on a steered node releases the one furthest from
empty."""

from __future__ import annotations

import pytest

from flexgpu.driver.allocation.node_clearing import (
    GroupNode,
    NodeHolder,
    choose_nodes,
    release_for,
)


def node(name: str, *held: float, age: float = 600.0, gpus: int = 8) -> GroupNode:
    holders = tuple(NodeHolder(f"ns/{name}-{i}", g, age) for i, g in enumerate(held))
    return GroupNode(name, gpus, holders)


def test_fewest_holders_first_and_an_empty_node_before_all() -> None:
    nodes = [node("busy", 1, 1, 1), node("two", 0.125, 0.125), node("empty"), node("one", 1)]
    assert choose_nodes(nodes, total_gpus=32, share=1.0) == ["empty", "one", "two"]


def test_among_equal_counts_the_oldest_holders_then_the_smallest() -> None:
    young = node("young", 0.125, age=60)
    old = node("old", 0.5, age=3600)
    assert choose_nodes([young, old, node("a", 2, 2)], total_gpus=24, share=0.34) == ["old"]
    small = node("small", 0.125)
    large = node("large", 0.5)
    assert choose_nodes([large, small, node("a", 2, 2)], total_gpus=24, share=0.34) == ["small"]


def test_a_known_end_wins_over_age_alone() -> None:
    ends_soon = GroupNode("soon", 8, (NodeHolder("ns/x", 1, 60, remaining_s=120),))
    unknown = GroupNode("unknown", 8, (NodeHolder("ns/y", 1, 7200),))
    chosen = choose_nodes([unknown, ends_soon, node("rest", 1, 1)], total_gpus=24, share=0.34)
    assert chosen == ["soon"]


def test_a_node_whose_holders_may_all_move_comes_before_one_that_holds_a_job() -> None:
    # Eviction empties the first within its bound; the second empties only when its job ends.
    movable = GroupNode(
        "movable",
        8,
        tuple(NodeHolder(f"ns/m{i}", 0.125, 60, movable=True) for i in range(3)),
    )
    pinned = GroupNode("pinned", 8, (NodeHolder("ns/job", 1, 7200, movable=False),))
    chosen = choose_nodes([pinned, movable, node("rest", 1, 1)], total_gpus=24, share=0.34)
    assert chosen == ["movable"]
    # Where nobody may move (eviction off), fewest holders first as before.
    still = GroupNode("still", 8, tuple(NodeHolder(f"ns/s{i}", 0.125, 60) for i in range(3)))
    assert choose_nodes([still, pinned, node("rest", 1, 1)], total_gpus=24, share=0.34) == [
        "pinned"
    ]


def test_bounded_by_a_share_of_the_clusters_gpus() -> None:
    nodes = [node("a"), node("b", 1), node("c", 1), node("d", 0.5)]
    # 32 GPUs, a quarter: one node of 8.
    assert choose_nodes(nodes, total_gpus=32, share=0.25) == ["a"]
    # Booting nodes count in the total: 48 GPUs, a quarter is 12: still one node.
    assert choose_nodes(nodes, total_gpus=48, share=0.25) == ["a"]
    # Under one node's worth of GPUs: none.
    assert choose_nodes(nodes, total_gpus=32, share=0.2) == []
    with pytest.raises(ValueError, match="between 0 and 1"):
        choose_nodes(nodes, total_gpus=32, share=1.5)


def test_only_when_the_rest_of_the_group_has_room_for_what_it_holds() -> None:
    # The other node has 1 GPU free: room for a node holding 1, not for one holding 2.
    assert choose_nodes([node("full", 7), node("x", 1)], total_gpus=16, share=1.0) == ["x"]
    assert choose_nodes([node("full", 6.5), node("x", 2)], total_gpus=16, share=1.0) == []
    # A second node is steered only if the rest holds both nodes' work.
    nodes = [node("rest", 6), node("x", 1), node("y", 1.5)]
    assert choose_nodes(nodes, total_gpus=24, share=1.0) == ["x"]
    # The only node of the group is never steered: there is no rest.
    assert choose_nodes([node("alone", 0.125)], total_gpus=8, share=1.0) == []


def test_a_node_more_than_half_full_is_not_worth_emptying() -> None:
    nodes = [node("half", 4), node("more", 4.125), node("empty")]
    assert choose_nodes(nodes, total_gpus=24, share=0.34) == ["empty"]
    assert choose_nodes([node("more", 4.125), node("x")], total_gpus=16, share=0.5) == ["x"]
    # Half full is the most that may be steered; the rest has room for its 4 GPUs.
    nodes = [node("more", 4.125), node("half", 4), node("other", 1, 1)]
    assert choose_nodes(nodes, total_gpus=24, share=1.0) == ["half"]


def test_a_steered_node_stays_steered_before_a_better_one() -> None:
    nodes = [node("steered", 1, 1), node("better"), node("rest")]
    chosen = choose_nodes(nodes, total_gpus=24, share=0.34, steered=["steered"])
    assert chosen == ["steered"]


def test_a_claim_that_fits_elsewhere_releases_nothing() -> None:
    nodes = [node("a", 1), node("b", 2, 2), node("free")]
    assert release_for(["free", "a"], ["a", "b"], nodes) is None
    assert release_for([], ["a", "b"], nodes) is None


def test_a_claim_that_fits_only_on_steered_nodes_releases_the_one_furthest_from_empty() -> None:
    nodes = [node("a", 1), node("b", 2, 2), node("c", 0.5, 0.5, 0.5)]
    assert release_for(["a", "b"], ["a", "b", "c"], nodes) == "b"
    assert release_for(["a"], ["a", "b", "c"], nodes) == "a"
    # Steered, but not described (no holders known): the first it fits on.
    assert release_for(["z"], ["z"], nodes) == "z"
