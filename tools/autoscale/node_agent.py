"""Plays the machines Karpenter launches: for each Node the kwok cloud provider creates in a
watched NodePool, reports it Ready and starts flexgpu's kubelet plugin (simulated backend, the
instance type's topology and flags) with the kubelet harness, so the node publishes real
ResourceSlices and runs its pods; when Karpenter has deleted the Node, stops them (the machine
is gone). One thread does all of it: the harness and plugin processes die with the thread
that started them (PR_SET_PDEATHSIG), so it lives until ``stop``."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from tools.autoscale.karpenter import INSTANCE_TYPE_LABEL, NODEPOOL_LABEL, GpuInstanceType
from tools.cluster.gpu_node import SimulatedGpuNode


@dataclass
class NodeRecord:
    """A node the agent has played: when it appeared, was ready (plugin registered, slices
    published) and went away (seconds since the agent started; None: not yet)."""

    name: str
    instance_type: str
    nodepool: str
    seen_s: float
    ready_s: float | None = None
    gone_s: float | None = None
    error: str | None = None


class NodeAgent:
    def __init__(
        self,
        kubeconfig: Path,
        instance_types: Mapping[str, GpuInstanceType],
        nodepools: set[str],
        poll_s: float = 0.5,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.instance_types = dict(instance_types)
        self.nodepools = nodepools
        self.poll_s = poll_s
        self.records: dict[str, NodeRecord] = {}
        self._nodes: dict[str, SimulatedGpuNode] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="node-agent", daemon=True)
        self._started = time.monotonic()
        self.api: Any = config.new_client_from_config(config_file=str(kubeconfig))

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def stop(self, timeout_s: float = 120) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def errors(self) -> list[str]:
        return [f"{r.name}: {r.error}" for r in self.records.values() if r.error]

    def _now(self) -> float:
        return time.monotonic() - self._started

    def _run(self) -> None:
        core = client.CoreV1Api(self.api)
        try:
            while not self._stop.is_set():
                try:
                    nodes = core.list_node(label_selector=NODEPOOL_LABEL).items
                except client.ApiException:
                    time.sleep(self.poll_s)
                    continue
                present = {n.metadata.name for n in nodes if n.metadata}
                for node in nodes:
                    self._maybe_start(node)
                for name in list(self._nodes):
                    if name not in present:
                        self._node_gone(name)
                self._stop.wait(self.poll_s)
        finally:
            for name in list(self._nodes):
                self._nodes.pop(name).cleanup()

    def _maybe_start(self, node: Any) -> None:
        name = node.metadata.name
        labels = node.metadata.labels or {}
        if name in self.records or labels.get(NODEPOOL_LABEL) not in self.nodepools:
            return
        record = NodeRecord(
            name, labels.get(INSTANCE_TYPE_LABEL, ""), labels[NODEPOOL_LABEL], self._now()
        )
        self.records[name] = record
        instance_type = self.instance_types.get(record.instance_type)
        if instance_type is None:
            record.error = f"instance type {record.instance_type!r} has no topology here"
            return
        sim = SimulatedGpuNode(
            self.kubeconfig,
            name,
            instance_type.topology,
            plugin_args=instance_type.plugin_args(),
            create_node=False,
        )
        self._nodes[name] = sim
        try:
            sim.start()
            record.ready_s = self._now()
        # Recorded for the test; the agent keeps serving the other nodes.
        except Exception:
            record.error = traceback.format_exc(limit=3)

    def _node_gone(self, name: str) -> None:
        self._nodes.pop(name).cleanup()
        self.records[name].gone_s = self._now()
