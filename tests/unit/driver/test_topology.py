from pathlib import Path

import pytest

from flexgpu.driver.topology import (
    TopologyError,
    builtin_topology_names,
    load_topology,
    parse_topology,
)


def test_builtin_topologies_load() -> None:
    names = builtin_topology_names()
    assert {"hgx-h100-8", "dgx-a100-8", "h200-4", "l4-2-pcie", "mixed"} <= set(names)
    for name in names:
        topology = load_topology(name)
        assert topology.name == name
    hgx = load_topology("hgx-h100-8")
    assert len(hgx.gpus) == 8 and hgx.nvlink.fabric == "nvswitch"
    assert {g.model for g in load_topology("mixed").gpus} == {"T4", "A100-SXM4-80GB"}


def test_user_file_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: mine\ngpus:\n  - model: L4\n    pciBusId: '00000000:0A:00.0'\n  - model: T4\n"
    )
    topology = load_topology(str(path))
    assert topology.gpus[0].pci_bus_id == "0000:0a:00.0"
    # Addresses the file leaves out are filled in, distinct per GPU.
    assert topology.bus_id(1) != topology.bus_id(0)
    assert topology.pcie_root(1).startswith("pci")
    assert topology.driver_version == "580.95.05"


def test_unknown_name_lists_builtins() -> None:
    with pytest.raises(TopologyError, match=r"built-in topologies: .*hgx-h100-8"):
        load_topology("hgx-h100-9")


def test_missing_file() -> None:
    with pytest.raises(TopologyError, match="cannot read topology file"):
        load_topology("/nonexistent/topo.yaml")


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        (
            {"name": "x", "gpus": [{"model": "V100"}]},
            "gpus.0.model: unknown GPU model 'V100'; allowed values: A100-SXM4-40GB",
        ),
        (
            {"name": "x", "gpus": [{"model": "T4", "migEnabled": True}]},
            "migEnabled: T4 has no MIG; models with MIG: A100-SXM4-40GB",
        ),
        (
            {"name": "x", "gpus": [{"model": "T4"}], "nvlink": {"fabric": "ring"}},
            "nvlink.fabric: Input should be 'none', 'nvswitch' or 'links'",
        ),
        (
            {
                "name": "x",
                "gpus": [{"model": "T4"}],
                "nvlink": {"fabric": "links", "links": [[0, 3]]},
            },
            "GPU index 3 out of range; allowed values: 0..0",
        ),
        (
            {"name": "x", "gpus": [{"model": "T4", "colour": "red"}]},
            "gpus.0.colour: unknown field; allowed fields: model, pciBusId",
        ),
        ({"name": "x", "gpus": []}, "gpus: Tuple should have at least 1 item"),
        (
            {"name": "x", "gpus": [{"model": "T4", "pciBusId": "0:0"}]},
            "gpus.0.pciBusId: malformed PCI bus id",
        ),
    ],
)
def test_validation_names_field_and_allowed_values(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "t.yaml")
    assert fragment in str(info.value)


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: [unclosed\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(path)
