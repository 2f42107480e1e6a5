"""Karpenter (sigs.k8s.io/karpenter with its kwok cloud provider:
tools/karpenter/cmd/karpenter-kwok) against the local control plane, its DRA simulation on,
with GPU instance types whose ``DynamicResources`` are flexgpu's node templates."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client

from flexgpu.driver.autoscaler_shapes import karpenter_dynamic_resources
from flexgpu.driver.node_template import TemplatePolicy, render_node_template
from flexgpu.driver.topology import load_topology
from tools import buildcache
from tools.cluster.process import Component

REPO = Path(__file__).resolve().parents[2]
NODEPOOL_LABEL = "karpenter.sh/nodepool"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
ZONE = "test-zone-a"


class KarpenterError(RuntimeError):
    pass


def _indices(gpus: frozenset[int]) -> str:
    return ",".join(str(i) for i in sorted(gpus))


@dataclass(frozen=True)
class GpuInstanceType:
    """One GPU instance type: a node of ``topology`` whose plugin runs with ``policy`` (the
    chart's sharedGpus / dynamicMigGpus), its CPU, memory and price."""

    name: str
    topology: str
    policy: TemplatePolicy = field(default_factory=TemplatePolicy)
    cpu: str = "32"
    memory: str = "256Gi"
    price: float = 10.0

    def plugin_args(self) -> tuple[str, ...]:
        args = []
        if self.policy.shared:
            args.append(f"--shared-gpus={_indices(self.policy.shared)}")
        if self.policy.dynamic_mig:
            args.append(f"--dynamic-mig-gpus={_indices(self.policy.dynamic_mig)}")
        return tuple(args)

    def kwok_entry(self) -> dict[str, Any]:
        """The instance type in the kwok provider's file format (INSTANCE_TYPES_FILE_PATH)."""
        return {
            "name": self.name,
            "architecture": "amd64",
            "operatingSystems": ["linux"],
            "resources": {"cpu": self.cpu, "memory": self.memory, "pods": "110"},
            "offerings": [
                {
                    "Price": self.price,
                    "Available": True,
                    "Requirements": [
                        {
                            "key": "karpenter.sh/capacity-type",
                            "operator": "In",
                            "values": ["on-demand"],
                        },
                        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [ZONE]},
                    ],
                }
            ],
        }

    def template(self) -> dict[str, Any]:
        """What ``flexgpu node-template --format karpenter`` prints for this instance type."""
        return karpenter_dynamic_resources(
            render_node_template(load_topology(self.topology), self.policy)
        )


def build() -> Path:
    """The karpenter-kwok binary (built into the cache on first use: many minutes cold)."""
    try:
        return buildcache.path("karpenter", "karpenter-kwok", timeout=3600) / "karpenter-kwok"
    except buildcache.BuildError as e:
        raise KarpenterError(str(e)) from e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def install_crds(api: Any, crd_dir: Path, timeout_s: float = 60) -> list[str]:
    """Creates (or replaces) Karpenter's CRDs and waits until each is Established."""
    extensions = client.ApiextensionsV1Api(api)
    names = []
    for path in sorted(crd_dir.glob("*.yaml")):
        manifest = yaml.safe_load(path.read_text(encoding="utf-8"))
        name = manifest["metadata"]["name"]
        names.append(name)
        try:
            extensions.create_custom_resource_definition(manifest)
        except client.ApiException as error:
            if error.status != 409:
                raise
            current = extensions.read_custom_resource_definition(name)
            # Replacing needs the stored object's version (the API server always sends it).
            assert current.metadata is not None
            manifest["metadata"]["resourceVersion"] = current.metadata.resource_version
            extensions.replace_custom_resource_definition(name, manifest)
    deadline = time.monotonic() + timeout_s
    for name in names:
        while True:
            crd = extensions.read_custom_resource_definition(name)
            conditions = (crd.status.conditions if crd.status else None) or []
            if any(c.type == "Established" and c.status == "True" for c in conditions):
                break
            if time.monotonic() > deadline:
                raise KarpenterError(f"CRD {name} not Established after {timeout_s:.0f}s")
            time.sleep(0.2)
    return names


class Karpenter:
    """The Karpenter process, its CRDs installed and its instance types written to ``workdir``."""

    def __init__(
        self,
        kubeconfig: Path,
        workdir: Path,
        instance_types: Sequence[GpuInstanceType],
        *,
        binary: Path | None = None,
        ignore_dra_requests: bool = False,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.workdir = workdir
        self.instance_types = list(instance_types)
        self.binary = binary
        self.ignore_dra_requests = ignore_dra_requests
        self.component: Component | None = None
        self.health_port = 0

    def start(self, api: Any, timeout_s: float = 120) -> None:
        binary = self.binary or build()
        install_crds(api, binary.parent / "crds")
        self.workdir.mkdir(parents=True, exist_ok=True)
        types_file = self.workdir / "instance-types.json"
        types_file.write_text(json.dumps([it.kwok_entry() for it in self.instance_types]))
        templates_file = self.workdir / "dra-templates.json"
        templates_file.write_text(
            json.dumps({it.name: it.template() for it in self.instance_types})
        )
        self.health_port = _free_port()
        env = {
            "KUBECONFIG": str(self.kubeconfig),
            "INSTANCE_TYPES_FILE_PATH": str(types_file),
            "FLEXGPU_DRA_TEMPLATES": str(templates_file),
            "IGNORE_DRA_REQUESTS": "true" if self.ignore_dra_requests else "false",
            "DISABLE_LEADER_ELECTION": "true",
            "METRICS_PORT": str(_free_port()),
            "HEALTH_PROBE_PORT": str(self.health_port),
            "LOG_LEVEL": "debug",
            # Short batches (defaults 1 s idle, 10 s at most): a test's pods arrive together, but
            # on a loaded machine their creations can be more than a second apart.
            "BATCH_IDLE_DURATION": "2s",
            "BATCH_MAX_DURATION": "10s",
            "CPU_REQUESTS": "1000",
            "PATH": "/usr/bin:/bin",
        }
        self.component = Component(
            "karpenter", [str(binary)], self.workdir / "karpenter.log", env=env
        )
        self.component.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.component.running():
                raise KarpenterError(
                    f"karpenter exited with code {self.component.exit_code()}; "
                    f"log {self.component.log_path}:\n{self.component.log_tail(60)}"
                )
            if self._ready():
                return
            time.sleep(0.5)
        raise KarpenterError(
            f"karpenter not ready after {timeout_s:.0f}s; log {self.component.log_path}:\n"
            f"{self.component.log_tail(60)}"
        )

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.health_port}/readyz", timeout=2
            ) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def log_tail(self, lines: int = 80) -> str:
        return self.component.log_tail(lines) if self.component else "(not started)"

    def stop(self) -> None:
        if self.component:
            self.component.stop()
