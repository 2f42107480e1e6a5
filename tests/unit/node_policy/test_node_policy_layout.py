"""validate_layout and layout_of: the examples admins write, the exact messages, and
properties checked against the simulated backend (which enforces NVML's rules)."""

from __future__ import annotations

import itertools
import tempfile
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_builders import gpus_of, h100

from flexgpu.driver.gpu_catalog import gpu_model
from flexgpu.driver.gpu_model import GpuInfo, MigPlacement, MigProfile
from flexgpu.driver.mig_layout import (
    LayoutError,
    LayoutProblem,
    MigPlacementPlan,
    compute_slice_count,
    layout_of,
    memory_slice_count,
    validate_layout,
)
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology

H100_PROFILES = list(gpu_model("H100-SXM5-80GB").mig_profiles)


def _plan(layout: dict[str, int]) -> list[tuple[str, int, int]]:
    return [
        (p.profile_name, p.placement_start, p.placement_size)
        for p in validate_layout(layout, h100(), H100_PROFILES)
    ]


def _error(layout: dict[str, int], gpu: GpuInfo | None = None, profiles=None) -> LayoutError:  # type: ignore[no-untyped-def]
    with pytest.raises(LayoutError) as caught:
        validate_layout(layout, gpu or h100(), H100_PROFILES if profiles is None else profiles)
    return caught.value


def test_seven_1g_fit_an_h100() -> None:
    assert _plan({"1g.10gb": 7}) == [("1g.10gb", s, 1) for s in range(7)]


def test_4g_and_3g_fit() -> None:
    assert _plan({"4g.40gb": 1, "3g.40gb": 1}) == [("4g.40gb", 0, 4), ("3g.40gb", 4, 4)]


def test_mixed_layout_fits_largest_first() -> None:
    assert _plan({"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 2}) == [
        ("2g.20gb", 0, 2),
        ("1g.10gb", 2, 1),
        ("1g.10gb", 3, 1),
        ("3g.40gb", 4, 4),
    ]


def test_backtracking_moves_the_3g_to_make_room() -> None:
    # 3g at 0 first leaves only 4-5 for a 2g (2g has no placement at 6): it must move to 4.
    assert _plan({"3g.40gb": 1, "2g.20gb": 2}) == [
        ("2g.20gb", 0, 2),
        ("2g.20gb", 2, 2),
        ("3g.40gb", 4, 4),
    ]


def test_plan_carries_profile_ids() -> None:
    plans = validate_layout({"7g.80gb": 1}, h100(), H100_PROFILES)
    assert plans == [MigPlacementPlan(0, 8, 0, "7g.80gb")]
    assert plans[0].placement == MigPlacement(start=0, size=8)


def test_empty_layout_is_no_instances() -> None:
    assert validate_layout({}, h100(), H100_PROFILES) == []


def test_two_3g_and_a_1g_need_more_memory_slices_than_there_are() -> None:
    # Compute 3+3+1 = 7 is fine; memory 4+4+1 = 9 > 8 (3g placements are 0-3 and 4-7).
    error = _error({"3g.40gb": 2, "1g.10gb": 1})
    assert error.reason is LayoutProblem.INVALID_LAYOUT
    assert error.message == (
        'layout {"3g.40gb": 2, "1g.10gb": 1} needs 9 memory slices; NVIDIA H100 80GB HBM3 has 8'
    )


def test_7g_and_1g_need_more_compute_slices_than_there_are() -> None:
    error = _error({"7g.80gb": 1, "1g.10gb": 1})
    assert error.reason is LayoutProblem.INVALID_LAYOUT
    assert error.message == (
        'layout {"7g.80gb": 1, "1g.10gb": 1} needs 8 compute slices; NVIDIA H100 80GB HBM3 has 7'
    )


def test_unknown_profile_is_unsupported_and_lists_what_is_offered() -> None:
    error = _error({"2g.35gb": 1})
    assert error.reason is LayoutProblem.UNSUPPORTED
    assert error.message == (
        'profile "2g.35gb" is not offered by NVIDIA H100 80GB HBM3; offered: 1g.10gb, '
        "1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb"
    )
    assert str(error) == error.message
    two = _error({"2g.35gb": 1, "1g.10gb": 1, "7g.141gb": 1})
    assert two.message.startswith('profiles "2g.35gb", "7g.141gb" are not offered by NVIDIA H100')


def test_a_profile_above_its_instance_limit() -> None:
    error = _error({"1g.10gb+me": 2})
    assert error.reason is LayoutProblem.INVALID_LAYOUT
    assert error.message == (
        "profile 1g.10gb+me: 2 instances are more than NVIDIA H100 80GB HBM3 allows (at most 1)"
    )
    assert _error({"1g.10gb": 8}).message == (
        "profile 1g.10gb: 8 instances are more than NVIDIA H100 80GB HBM3 allows (at most 7)"
    )


def test_gpu_without_mig_is_unsupported() -> None:
    t4 = gpus_of("mixed")[0]
    error = _error({"1g.10gb": 1}, gpu=t4, profiles=[])
    assert error.reason is LayoutProblem.UNSUPPORTED
    assert error.message == "Tesla T4 (GPU 0) has no MIG"


def test_placements_that_cannot_be_kept_apart() -> None:
    # A GPU whose 1g profile offers only slice 0 (NVML may offer fewer placements than the
    # table): two of them cannot coexist although slices and limits allow it.
    narrow = [
        p.model_copy(update={"placements": (MigPlacement(start=0, size=1),)})
        if p.name == "1g.10gb"
        else p
        for p in H100_PROFILES
    ]
    error = _error({"1g.10gb": 2, "2g.20gb": 1}, profiles=narrow)
    assert error.reason is LayoutProblem.INVALID_LAYOUT
    assert error.message == (
        'layout {"1g.10gb": 2, "2g.20gb": 1} does not fit NVIDIA H100 80GB HBM3: no choice of '
        "placements keeps the instances' memory slices apart (memory slices each profile may "
        "take: 2g.20gb at 0-1, 2-3, 4-5; 1g.10gb at 0)"
    )


def test_bad_counts_in_a_raw_mapping() -> None:
    assert _error({"1g.10gb": -1}).message == (
        "profile 1g.10gb: -1 instances is not a count; allowed: 0 to 7"
    )
    assert _error({"1g.10gb": True}).reason is LayoutProblem.INVALID_LAYOUT  # type: ignore[dict-item]
    assert validate_layout({"1g.10gb": 0, "7g.80gb": 1}, h100(), H100_PROFILES)[0].profile_id == 0


def test_slice_counts_come_from_the_profiles() -> None:
    assert memory_slice_count(H100_PROFILES) == 8
    assert compute_slice_count(H100_PROFILES) == 7
    assert memory_slice_count([]) == 0


# --------------------------------------------------------------------------- layout_of


def test_layout_of_counts_devices_by_profile(tmp_path: Path) -> None:
    backend = SimulatedBackend(load_topology("h200-4"), "node", tmp_path / "state.json")
    assert layout_of(backend.list_mig_devices(0)) == {}
    for plan in validate_layout(
        {"3g.71gb": 1, "1g.18gb": 2, "2g.35gb": 1}, backend.list_gpus()[0], backend.mig_profiles(0)
    ):
        backend.create_mig_device(0, plan.profile_id, plan.placement)
    current = layout_of(backend.list_mig_devices(0))
    assert current == {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}
    assert list(current) == sorted(current)
    assert current == {"3g.71gb": 1, "1g.18gb": 2, "2g.35gb": 1}  # order does not matter


# --------------------------------------------------------------------------- properties

FAMILIES = {
    "A100-SXM4-40GB": "dgx-a100-8",
    "H100-SXM5-80GB": "hgx-h100-8",
    "H200-SXM5-141GB": "h200-4",
}


@cache
def _feasible(profiles: tuple[MigProfile, ...]) -> frozenset[frozenset[tuple[str, int]]]:
    """Every layout some set of non-overlapping instances forms, by brute force over all
    (profile, placement) slots: an oracle independent of the search."""
    slots = [(p, pl) for p in profiles for pl in p.placements]
    compute = compute_slice_count(list(profiles))
    found: set[frozenset[tuple[str, int]]] = set()

    def grow(start: int, taken: list[tuple[MigProfile, MigPlacement]]) -> None:
        counts = Counter(p.name for p, _ in taken)
        limits = {p.name: p.max_instances for p in profiles}
        if sum(p.compute_slices for p, _ in taken) > compute:
            return
        if any(counts[name] > limits[name] for name in counts):
            return
        found.add(frozenset(counts.items()))
        for i in range(start, len(slots)):
            profile, placement = slots[i]
            if any(placement.overlaps(other) for _, other in taken):
                continue
            grow(i + 1, [*taken, (profile, placement)])

    grow(0, [])
    return frozenset(found)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_accepted_exactly_when_some_placement_exists(family: str) -> None:
    """Every combination of counts up to each profile's limit: validate_layout accepts it
    if and only if the brute-force oracle finds a set of non-overlapping instances."""
    profiles = gpu_model(family).mig_profiles
    gpu = gpus_of(FAMILIES[family])[0]
    feasible = _feasible(profiles)
    accepted = 0
    for counts in itertools.product(*(range(p.max_instances + 1) for p in profiles)):
        layout = {p.name: c for p, c in zip(profiles, counts, strict=True) if c}
        try:
            validate_layout(layout, gpu, list(profiles))
            ok = True
        except LayoutError:
            ok = False
        assert ok == (frozenset(layout.items()) in feasible), layout
        accepted += ok
    assert accepted == len(feasible)


layouts = st.dictionaries(
    st.sampled_from([p.name for p in gpu_model("H200-SXM5-141GB").mig_profiles]),
    st.integers(min_value=1, max_value=7),
    max_size=7,
)


@settings(max_examples=200, deadline=None)
@given(layout=layouts, gpu_index=st.integers(min_value=0, max_value=3))
def test_accepted_layouts_can_be_created_on_the_simulated_backend(
    layout: dict[str, int], gpu_index: int
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        backend = SimulatedBackend(load_topology("h200-4"), "node", Path(folder) / "state.json")
        gpu = backend.list_gpus()[gpu_index]
        try:
            plans = validate_layout(layout, gpu, backend.mig_profiles(gpu_index))
        except LayoutError:
            return
        for plan in plans:
            device = backend.create_mig_device(gpu_index, plan.profile_id, plan.placement)
            assert device.profile_name == plan.profile_name
        assert layout_of(backend.list_mig_devices(gpu_index)) == dict(sorted(layout.items()))


@settings(max_examples=200, deadline=None)
@given(
    layout=st.dictionaries(
        st.sampled_from([p.name for p in H100_PROFILES]),
        st.integers(min_value=1, max_value=7),
        max_size=7,
    ),
    order=st.randoms(use_true_random=False),
)
def test_plans_can_be_created_in_any_order(layout: dict[str, int], order) -> None:  # type: ignore[no-untyped-def]
    try:
        plans = validate_layout(layout, h100(), H100_PROFILES)
    except LayoutError:
        return
    order.shuffle(plans)
    with tempfile.TemporaryDirectory() as folder:
        backend = SimulatedBackend(load_topology("hgx-h100-8"), "node", Path(folder) / "s.json")
        backend.set_mig_mode(0, True)
        for plan in plans:
            backend.create_mig_device(0, plan.profile_id, plan.placement)
        assert layout_of(backend.list_mig_devices(0)) == dict(sorted(layout.items()))
