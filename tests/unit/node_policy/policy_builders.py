"""Builders shared by the GpuNodePolicy unit tests."""

from __future__ import annotations

import tempfile
from functools import cache
from pathlib import Path
from typing import Any

from flexgpu.driver.gpu_model import GpuInfo
from flexgpu.driver.node_policy import GpuNodePolicy, parse_node_policy
from flexgpu.driver.sim_backend import SimulatedBackend
from flexgpu.driver.topology import load_topology


def manifest(name: str = "p", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": name},
        "spec": spec,
    }


def policy(name: str = "p", **spec: Any) -> GpuNodePolicy:
    return parse_node_policy(manifest(name, **spec))


@cache
def gpus_of(topology: str) -> tuple[GpuInfo, ...]:
    with tempfile.TemporaryDirectory() as folder:
        backend = SimulatedBackend(load_topology(topology), "node", Path(folder) / "state.json")
        return tuple(backend.list_gpus())


def h100() -> GpuInfo:
    return gpus_of("hgx-h100-8")[0]
