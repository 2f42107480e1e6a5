import pytest

from flexgpu.driver.gpu_catalog import GPU_CATALOG, gpu_model, spec_for_product_name
from flexgpu.driver.mig_catalog import (
    COMPUTE_SLICES,
    MEMORY_SLICES,
    MIG_PRODUCT_FAMILIES,
    mig_profiles_for,
)

EXPECTED_NAMES = {
    "A100-SXM4-40GB": [
        "1g.5gb",
        "1g.5gb+me",
        "1g.10gb",
        "2g.10gb",
        "3g.20gb",
        "4g.20gb",
        "7g.40gb",
    ],
    "A100-SXM4-80GB": [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ],
    "H100-SXM5-80GB": [
        "1g.10gb",
        "1g.10gb+me",
        "1g.20gb",
        "2g.20gb",
        "3g.40gb",
        "4g.40gb",
        "7g.80gb",
    ],
    "B200-SXM6-180GB": [
        "1g.23gb",
        "1g.23gb+me",
        "1g.45gb",
        "2g.45gb",
        "3g.90gb",
        "4g.90gb",
        "7g.180gb",
    ],
    "H200-SXM5-141GB": [
        "1g.18gb",
        "1g.18gb+me",
        "1g.35gb",
        "2g.35gb",
        "3g.71gb",
        "4g.71gb",
        "7g.141gb",
    ],
}


@pytest.mark.parametrize("key", sorted(EXPECTED_NAMES))
def test_profile_names_ids_and_placements(key: str) -> None:
    profiles = gpu_model(key).mig_profiles
    assert [p.name for p in profiles] == EXPECTED_NAMES[key]
    by_id = {p.profile_id: p for p in profiles}
    assert sorted(by_id) == [0, 5, 9, 14, 15, 19, 20]
    starts = {pid: [pl.start for pl in p.placements] for pid, p in by_id.items()}
    assert starts == {
        19: [0, 1, 2, 3, 4, 5, 6],
        20: [0, 1, 2, 3, 4, 5, 6],
        15: [0, 2, 4, 6],
        14: [0, 2, 4],
        9: [0, 4],
        5: [0],
        0: [0],
    }
    sizes = {pid: {pl.size for pl in p.placements} for pid, p in by_id.items()}
    assert sizes == {19: {1}, 20: {1}, 15: {2}, 14: {2}, 9: {4}, 5: {4}, 0: {8}}
    assert {pid: p.max_instances for pid, p in by_id.items()} == {
        19: 7,
        20: 1,
        15: 4,
        14: 3,
        9: 2,
        5: 1,
        0: 1,
    }
    assert {pid: p.compute_slices for pid, p in by_id.items()} == {
        19: 1,
        20: 1,
        15: 1,
        14: 2,
        9: 3,
        5: 4,
        0: 7,
    }


@pytest.mark.parametrize("family", MIG_PRODUCT_FAMILIES)
def test_profiles_fit_the_gpu_geometry(family: str) -> None:
    for profile in mig_profiles_for(family):
        assert profile.memory_slices == profile.placements[0].size
        assert all(p.end <= MEMORY_SLICES for p in profile.placements)
        assert profile.compute_slices <= COMPUTE_SLICES
        # Bigger slices never get less memory or fewer SMs than smaller ones.
    ordered = sorted(mig_profiles_for(family), key=lambda p: (p.memory_slices, p.compute_slices))
    assert [p.memory_mib for p in ordered] == sorted(p.memory_mib for p in ordered)
    assert [p.multiprocessors for p in ordered] == sorted(p.multiprocessors for p in ordered)


def test_documented_figures() -> None:
    a100 = {p.name: p for p in gpu_model("A100-SXM4-40GB").mig_profiles}
    assert [a100[n].memory_mib for n in EXPECTED_NAMES["A100-SXM4-40GB"]] == [
        4864,
        4864,
        9856,
        9856,
        19968,
        19968,
        40192,
    ]
    assert [a100[n].multiprocessors for n in EXPECTED_NAMES["A100-SXM4-40GB"]] == [
        14,
        14,
        14,
        28,
        42,
        56,
        98,
    ]
    # Media extensions: only +me and the full GPU get the JPEG decoder and OFA on A100.
    assert a100["1g.5gb+me"].engines.ofa == 1 and a100["1g.5gb"].engines.ofa == 0
    assert a100["7g.40gb"].engines.decoders == 5
    h100 = {p.name: p for p in gpu_model("H100-SXM5-80GB").mig_profiles}
    assert h100["1g.10gb"].multiprocessors == 16
    assert h100["7g.80gb"].multiprocessors == 132 == gpu_model("H100-SXM5-80GB").multiprocessors
    assert h100["7g.80gb"].engines.jpeg_decoders == 7
    h200 = {p.name: p for p in gpu_model("H200-SXM5-141GB").mig_profiles}
    assert h200["1g.18gb"].memory_mib == 18432
    assert h200["2g.35gb"].memory_mib == h200["1g.35gb"].memory_mib == 35840


def test_non_mig_models_and_lookup() -> None:
    assert not gpu_model("L4").mig_capable
    assert not gpu_model("T4").mig_capable
    assert gpu_model("A100-SXM4-80GB").mig_capable
    assert spec_for_product_name("NVIDIA H100 80GB HBM3") is GPU_CATALOG["H100-SXM5-80GB"]
    assert spec_for_product_name("Tesla T4") is GPU_CATALOG["T4"]
    assert spec_for_product_name("NVIDIA B200") is GPU_CATALOG["B200-SXM6-180GB"]
    assert spec_for_product_name("NVIDIA GB300") is None
    with pytest.raises(KeyError, match="allowed: A100-SXM4-40GB"):
        gpu_model("V100")
