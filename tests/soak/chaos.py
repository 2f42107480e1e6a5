"""Random faults for the soak, one at a time: a plugin SIGKILLed at a random moment, a plugin
armed to SIGKILL itself at a named step of its next prepare or unprepare (so kills also land
mid-operation, not only between them), an apiserver restart with a short outage, and the
deletion of a node's ResourceSlices. Every killed plugin is started again."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kubernetes import client

from tools.cluster import ControlPlane
from tools.cluster.gpu_node import NodeError, SimulatedGpuNode

DRIVER = "gpu.flexgpu.dev"
# The plugin's named steps (kubelet_plugin/claims/preparer.py, FLEXGPU_FAULT_CRASH_AT).
CRASH_STEPS = (
    "prepare-locked",
    "after-prepare-started",
    "after-devices-created",
    "after-metadata-written",
    "after-cdi-written",
    "unprepare-locked",
    # Binding conditions (1.36+): a partition made before binding, a shared GPU's tenant.
    "early-recorded",
    "early-created",
    "early-ready",
    "tenant-decided",
)
_CRASHED = "fault injection: SIGKILL at"


def slices(resource: Any, node: str) -> list[Any]:
    selector = f"spec.nodeName={node},spec.driver={DRIVER}"
    return list(resource.list_resource_slice(field_selector=selector).items)


def poll(predicate: Callable[[], Any], timeout_s: float, interval_s: float = 0.5) -> Any:
    """The first truthy answer of predicate within timeout_s, else None; API errors (an
    apiserver restarting) count as a falsy answer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            answer = predicate()
        except Exception:  # retried until the deadline
            answer = None
        if answer:
            return answer
        time.sleep(interval_s)
    return None


class Chaos:
    def __init__(
        self,
        cluster: ControlPlane,
        nodes: dict[str, SimulatedGpuNode],
        rng: random.Random,
        problems: list[str],
    ) -> None:
        self.cluster = cluster
        self.nodes = nodes
        self.rng = rng
        self.problems = problems
        self.resource = client.ResourceV1Api(cluster.api_client())
        self.counts: Counter[str] = Counter()
        self.slice_return_s: list[float] = []
        # Held while a plugin is stopped or started, so no one sees it down in between.
        self.plugin_lock = threading.Lock()
        # Node name -> step its plugin will SIGKILL itself at.
        self.armed: dict[str, str] = {}

    def act(self) -> None:
        action = self.rng.choices(
            ["kill", "crash-step", "apiserver", "slices"], weights=[3, 3, 2, 2]
        )[0]
        node = self.rng.choice(list(self.nodes.values()))
        if action == "kill":
            with self.plugin_lock:
                self._kill(node)
                self._start(node, None)
        elif action == "crash-step":
            with self.plugin_lock:
                if node.name in self.armed:
                    return
                step = self.rng.choice(CRASH_STEPS)
                self._kill(node)
                self.armed[node.name] = step
                self.counts[f"plugin armed to crash at {step}"] += 1
                self._start(node, step)
        elif action == "apiserver":
            self.cluster.restart_apiserver(down_s=self.rng.uniform(1.0, 5.0))
            self.counts["apiserver restart"] += 1
        else:
            self._delete_slices(node)

    def revive(self, disarm: bool = False) -> None:
        """Starts again every armed plugin that killed itself (and checks it did so at its
        step); with disarm, also restarts the armed ones still waiting, unarmed."""
        with self.plugin_lock:
            for name, step in list(self.armed.items()):
                node = self.nodes[name]
                assert node.plugin is not None
                if node.plugin.running():
                    if disarm:
                        node.stop_plugin()
                        self._start(node, None)
                        del self.armed[name]
                    continue
                if f"{_CRASHED} {step}" in node.plugin.log_tail(200):
                    self.counts[f"plugin killed itself at {step}"] += 1
                else:
                    self.problems.append(
                        f"{name}: plugin armed for {step} exited with "
                        f"{node.plugin.exit_code()} (log {node.plugin.log_path})"
                    )
                del self.armed[name]
                self._start(node, None)

    def dead_plugins(self) -> list[str]:
        """Plugins that exited without chaos asking them to."""
        with self.plugin_lock:
            return [
                f"{n.name}: plugin exited with {n.plugin.exit_code()} unasked "
                f"(log {n.plugin.log_path})"
                for n in self.nodes.values()
                if n.plugin is not None and not n.plugin.running() and n.name not in self.armed
            ]

    def _kill(self, node: SimulatedGpuNode) -> None:
        node.stop_plugin(signal.SIGKILL)
        self.counts[f"plugin SIGKILL ({node.name})"] += 1

    def _start(self, node: SimulatedGpuNode, crash_at: str | None) -> None:
        node.plugin_env = dict(os.environ, FLEXGPU_FAULT_CRASH_AT=crash_at) if crash_at else None
        try:
            node.start_plugin(timeout_s=180)
        except NodeError:
            # An armed plugin may meet its step (a prepare the kubelet retries at once)
            # before the start-up wait saw it registered: revive() takes it from here.
            if not (crash_at and node.plugin and _CRASHED in node.plugin.log_tail(200)):
                raise
        finally:
            node.plugin_env = None

    def _delete_slices(self, node: SimulatedGpuNode) -> None:
        before = {s.metadata.uid for s in slices(self.resource, node.name)}
        self.resource.delete_collection_resource_slice(
            field_selector=f"spec.nodeName={node.name},spec.driver={DRIVER}"
        )
        self.counts[f"slices deleted ({node.name})"] += 1
        start = time.monotonic()
        back = poll(
            lambda: [s for s in slices(self.resource, node.name) if s.metadata.uid not in before],
            timeout_s=120,
        )
        if back:
            self.slice_return_s.append(time.monotonic() - start)
        else:
            self.problems.append(f"{node.name}: slices not back 120 s after deletion")
