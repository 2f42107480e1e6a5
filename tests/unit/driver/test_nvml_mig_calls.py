"""Creating a MIG partition reads the GPU's MIG profiles and placements once per GPU and MIG
mode, not on every create: the second create on a GPU makes no profile or placement query
and fewer NVML calls in all, with the same result as the first; the UUID lookup of the new
device stops at it. On the Python stand-in for pynvml, which counts the calls."""

from __future__ import annotations

from pathlib import Path

from fake_pynvml import FakeNvml, a100_80gb

from flexgpu.driver.gpu_model import MigDevice, MigPlacement
from flexgpu.driver.nvml_backend import NvmlBackend
from flexgpu.driver.sysfs import SysfsPci

UUID = "GPU-00000000-0000-4000-8000-000000000000"
BUS = "00000000:10:00.0"
PROFILE_QUERIES = {
    "nvmlDeviceGetGpuInstanceProfileInfo",
    "nvmlDeviceGetGpuInstancePossiblePlacements",
}
ONE_G = 19  # 1g.10gb on an A100 80GB


def _create(backend: NvmlBackend, nvml: FakeNvml, start: int) -> tuple[list[str], MigDevice]:
    before = len(nvml.calls)
    made = backend.create_mig_device(0, ONE_G, MigPlacement(start=start, size=1))
    return nvml.calls[before:], made


def test_profiles_are_read_once_per_gpu_and_mode(tmp_path: Path) -> None:
    nvml = FakeNvml([a100_80gb(UUID, BUS)])
    backend = NvmlBackend(nvml=nvml, sysfs=SysfsPci(tmp_path))
    first, made_first = _create(backend, nvml, 0)
    second, made_second = _create(backend, nvml, 1)

    assert PROFILE_QUERIES & set(first), "the first create reads the profiles"
    assert not PROFILE_QUERIES & set(second), second
    assert len(second) < len(first) / 2, (len(first), len(second))
    assert made_second.uuid and made_second.uuid != made_first.uuid
    listed = [d.uuid for d in backend.list_mig_devices(0)]
    assert listed == [made_first.uuid, made_second.uuid]
    # The placements a caller asks for come from the same read.
    before = len(nvml.calls)
    placements = backend.possible_placements(0, ONE_G)
    assert [p.start for p in placements] == list(range(7))
    assert not PROFILE_QUERIES & set(nvml.calls[before:])
    # Listing profiles answers the same as before the cache.
    assert [p.profile_id for p in backend.mig_profiles(0)][:1] == [ONE_G]
