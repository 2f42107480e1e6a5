from pathlib import Path

import pytest

from flexgpu.driver.nvlink import NVSWITCH, nvlink_domains, nvlink_peers
from flexgpu.driver.pci_address import normalize_pci_bus_id
from flexgpu.driver.sysfs import SysfsPci


def test_direct_links_form_components() -> None:
    links = {"a": {"b"}, "b": set(), "c": {"d"}, "d": {"c"}, "e": set()}
    domains = nvlink_domains(links)
    assert domains["a"] == domains["b"]
    assert domains["c"] == domains["d"]
    assert len({domains["a"], domains["c"], domains["e"]}) == 3
    # One-sided listings count both ways.
    assert nvlink_peers(links)["b"] == {"a"}


def test_chain_is_one_domain_but_peers_are_direct() -> None:
    links = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert len(set(nvlink_domains(links).values())) == 1
    assert nvlink_peers(links)["a"] == {"b"}


def test_nvswitch_joins_every_attached_gpu() -> None:
    links = {"a": {NVSWITCH}, "b": {NVSWITCH}, "c": {NVSWITCH}, "d": set()}
    domains = nvlink_domains(links)
    assert domains["a"] == domains["b"] == domains["c"] != domains["d"]
    assert nvlink_peers(links)["a"] == {"b", "c"}


def test_domain_names_are_stable_and_member_dependent() -> None:
    first = nvlink_domains({"a": {"b"}, "b": set()})
    again = nvlink_domains({"b": {"a"}, "a": set()})
    other = nvlink_domains({"a": {"c"}, "c": set()})
    assert first == again
    assert first["a"] != other["a"]
    assert first["a"].startswith("nvl-")


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:3B:00.0", "0000:3b:00.0"),
        ("0000:07:00.0", "0000:07:00.0"),
        ("07:00.1", "0000:07:00.1"),
        ("00000001:C1:1F.7", "0001:c1:1f.7"),
    ],
)
def test_bus_id_normalisation(raw: str, expected: str) -> None:
    assert normalize_pci_bus_id(raw) == expected


def test_bus_id_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="malformed PCI bus id"):
        normalize_pci_bus_id("0000:07:00")


def _fake_sysfs(root: Path, bus_id: str, numa: str) -> None:
    device = root / "devices" / "pci0000:3a" / "0000:3a:00.0" / bus_id
    device.mkdir(parents=True)
    (device / "numa_node").write_text(numa + "\n")
    links = root / "bus" / "pci" / "devices"
    links.mkdir(parents=True, exist_ok=True)
    (links / bus_id).symlink_to(device)


def test_sysfs_numa_and_root(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path, "0000:3b:00.0", "1")
    sysfs = SysfsPci(tmp_path)
    assert sysfs.numa_node("00000000:3B:00.0") == 1
    assert sysfs.pcie_root("00000000:3B:00.0") == "pci0000:3a"


def test_sysfs_unknowns(tmp_path: Path) -> None:
    _fake_sysfs(tmp_path, "0000:3b:00.0", "-1")
    sysfs = SysfsPci(tmp_path)
    assert sysfs.numa_node("0000:3b:00.0") is None
    assert sysfs.numa_node("0000:99:00.0") is None
    assert sysfs.pcie_root("0000:99:00.0") is None
