"""Node topology files for the simulated backend: which GPUs a simulated node has, on which PCI
addresses and NUMA nodes, and how they are linked by NVLink.

Built-in topologies ship as YAML in ``driver/topologies``; users may point at their own file.
Validation errors name the field and the allowed values.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from flexgpu.driver.gpu_catalog import GPU_CATALOG, gpu_model
from flexgpu.driver.pci_address import normalize_pci_bus_id


class TopologyError(ValueError):
    """A topology could not be found or is invalid; the message says where and why."""


class _TopologyModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True
    )


class TopologyGpu(_TopologyModel):
    model: str
    pci_bus_id: str | None = None
    pcie_root: str | None = None
    numa_node: int | None = Field(default=0, ge=0)
    mig_enabled: bool = False

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in GPU_CATALOG:
            raise ValueError(
                f"unknown GPU model {value!r}; allowed values: {', '.join(GPU_CATALOG)}"
            )
        return value

    @field_validator("pci_bus_id")
    @classmethod
    def _normalized_bus_id(cls, value: str | None) -> str | None:
        return None if value is None else normalize_pci_bus_id(value)

    @field_validator("pcie_root")
    @classmethod
    def _root_form(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("pci"):
            raise ValueError(f"pcieRoot {value!r} must look like 'pci0000:00'")
        return value

    @model_validator(mode="after")
    def _mig_needs_capable_model(self) -> Self:
        if self.mig_enabled and not gpu_model(self.model).mig_capable:
            capable = [key for key, spec in GPU_CATALOG.items() if spec.mig_capable]
            raise ValueError(
                f"migEnabled: {self.model} has no MIG; models with MIG: {', '.join(capable)}"
            )
        return self


class NvlinkFabric(_TopologyModel):
    """``none``: PCIe only. ``nvswitch``: every GPU on one NVSwitch fabric. ``links``: direct
    GPU-to-GPU links listed as index pairs."""

    fabric: Literal["none", "nvswitch", "links"] = "none"
    links: tuple[tuple[int, int], ...] = ()

    @model_validator(mode="after")
    def _links_only_for_links(self) -> Self:
        if self.links and self.fabric != "links":
            raise ValueError("links: only allowed with fabric: links")
        return self


class NodeTopology(_TopologyModel):
    name: str = Field(min_length=1)
    description: str = ""
    driver_version: str = "580.95.05"
    cuda_driver_version: str = "13.0"
    gpus: tuple[TopologyGpu, ...] = Field(min_length=1)
    nvlink: NvlinkFabric = NvlinkFabric()

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        count = len(self.gpus)
        for a, b in self.nvlink.links:
            for end in (a, b):
                if not 0 <= end < count:
                    raise ValueError(
                        f"nvlink.links: GPU index {end} out of range; "
                        f"allowed values: 0..{count - 1}"
                    )
            if a == b:
                raise ValueError(f"nvlink.links: GPU {a} linked to itself")
        bus_ids = [gpu.pci_bus_id for gpu in self.gpus if gpu.pci_bus_id is not None]
        if len(bus_ids) != len(set(bus_ids)):
            raise ValueError("gpus: pciBusId values must be unique")
        return self

    def bus_id(self, index: int) -> str:
        """The GPU's PCI address; a stable made-up one when the file gives none."""
        return self.gpus[index].pci_bus_id or f"0000:{0x10 + index * 0x10:02x}:00.0"

    def pcie_root(self, index: int) -> str:
        gpu = self.gpus[index]
        return gpu.pcie_root or f"pci{self.bus_id(index)[:4]}:{0x0F + index * 0x10:02x}"


def with_mig_off(topology: NodeTopology) -> NodeTopology:
    """``topology`` with MIG mode off on every GPU, as such machines ship (benchmarks and the
    demo want whole GPUs where the built-in topology has some in MIG mode)."""
    gpus = tuple(g.model_copy(update={"mig_enabled": False}) for g in topology.gpus)
    return topology.model_copy(update={"gpus": gpus})


def builtin_topology_names() -> list[str]:
    folder = resources.files("flexgpu.driver") / "topologies"
    return sorted(
        entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml")
    )


def load_topology(ref: str | Path) -> NodeTopology:
    """Load a built-in topology by name (``hgx-h100-8``) or a user's file by path."""
    text, origin = _read(ref)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise TopologyError(f"{origin}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise TopologyError(f"{origin}: expected a mapping at the top level")
    return parse_topology(data, origin)


def parse_topology(data: dict[str, object], origin: str = "topology") -> NodeTopology:
    try:
        return NodeTopology.model_validate(data)
    except ValidationError as exc:
        raise TopologyError(f"{origin}: invalid topology:\n{_describe(exc)}") from None


def _read(ref: str | Path) -> tuple[str, str]:
    path = Path(ref)
    looks_like_path = isinstance(ref, Path) or path.suffix in {".yaml", ".yml"} or "/" in str(ref)
    if looks_like_path:
        try:
            return path.read_text(), str(path)
        except OSError as exc:
            raise TopologyError(f"cannot read topology file {path}: {exc.strerror}") from None
    resource = resources.files("flexgpu.driver") / "topologies" / f"{ref}.yaml"
    if not resource.is_file():
        names = ", ".join(builtin_topology_names())
        raise TopologyError(f"unknown topology {ref!r}; built-in topologies: {names}")
    return resource.read_text(), f"topology {ref}"


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        location = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = f"unknown field; allowed fields: {', '.join(_allowed_fields(error['loc']))}"
        lines.append(f"  {location}: {message}")
    return "\n".join(lines)


def _allowed_fields(location: tuple[int | str, ...]) -> list[str]:
    section = location[0] if len(location) > 1 else None
    model: type[_TopologyModel] = NodeTopology
    if section == "gpus":
        model = TopologyGpu
    elif section == "nvlink":
        model = NvlinkFabric
    return [field.alias or name for name, field in model.model_fields.items()]
