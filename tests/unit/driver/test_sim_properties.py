"""Property tests: random MIG create/destroy sequences on the simulated backend."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from flexgpu.driver.backend_errors import InsufficientResourcesError, InvalidArgumentError
from flexgpu.driver.gpu_catalog import gpu_model
from flexgpu.driver.gpu_model import MigDevice, MigPlacement
from flexgpu.driver.sim_backend import SimulatedBackend

PROFILES = {p.profile_id: p for p in gpu_model("H200-SXM5-141GB").mig_profiles}

create = st.tuples(
    st.just("create"),
    st.sampled_from(sorted(PROFILES)),
    st.integers(min_value=0, max_value=7),
    st.integers(min_value=0, max_value=3),  # GPU index on h200-4
)
destroy = st.tuples(
    st.just("destroy"),
    st.integers(min_value=0, max_value=20),  # which existing instance, modulo the count
    st.just(0),
    st.integers(min_value=0, max_value=3),
)
operations = st.lists(st.one_of(create, destroy), max_size=25)


def _fits(devices: list[MigDevice], profile_id: int, placement: MigPlacement) -> bool:
    """Independent oracle for whether NVML would accept the create."""
    profile = PROFILES[profile_id]
    if placement not in profile.placements:
        return False
    if sum(d.profile_id == profile_id for d in devices) >= profile.max_instances:
        return False
    taken = {s for d in devices for s in range(d.placement.start, d.placement.end)}
    if taken & set(range(placement.start, placement.end)):
        return False
    used = sum(PROFILES[d.profile_id].compute_slices for d in devices)
    return used + profile.compute_slices <= 7


def _check_invariants(devices: list[MigDevice]) -> None:
    slices = [s for d in devices for s in range(d.placement.start, d.placement.end)]
    assert len(slices) == len(set(slices)), "overlapping MIG instances"
    assert sum(PROFILES[d.profile_id].compute_slices for d in devices) <= 7
    for profile_id, profile in PROFILES.items():
        assert sum(d.profile_id == profile_id for d in devices) <= profile.max_instances
    assert len({d.uuid for d in devices}) == len(devices)
    assert len({d.gpu_instance_id for d in devices}) == len(devices)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_random_mig_sequences_keep_invariants_and_survive_restart(
    ops: list[tuple[str, int, int, int]],
) -> None:
    with tempfile.TemporaryDirectory() as folder:
        state = Path(folder) / "state.json"
        backend = SimulatedBackend.from_topology("h200-4", "prop-node", state)
        for kind, a, b, gpu in ops:
            before = backend.list_mig_devices(gpu)
            if kind == "create":
                size = PROFILES[a].memory_slices
                placement = MigPlacement(start=b, size=size)
                expected = _fits(before, a, placement)
                try:
                    backend.create_mig_device(gpu, a, placement)
                    assert expected, f"accepted {a} at {b} next to {before}"
                except (InsufficientResourcesError, InvalidArgumentError):
                    assert not expected, f"refused {a} at {b} next to {before}"
                    assert backend.list_mig_devices(gpu) == before
            elif before:
                victim = before[a % len(before)]
                backend.destroy_mig_device(gpu, victim.gpu_instance_id)
                assert victim not in backend.list_mig_devices(gpu)
            _check_invariants(backend.list_mig_devices(gpu))
        restarted = SimulatedBackend.from_topology("h200-4", "prop-node", state)
        for gpu in range(4):
            assert restarted.list_mig_devices(gpu) == backend.list_mig_devices(gpu)
        assert restarted.list_gpus() == backend.list_gpus()
