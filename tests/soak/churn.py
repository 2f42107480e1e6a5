"""Pod churn for the soak: claims of every kind flexgpu prepares, each with one pod pinned to
the node that offers that kind, created at a bounded rate and deleted after a short random
life. Every API call may fail (the apiserver restarts under it): a failed step is retried on
the next tick, so each workload moves claim -> pod -> deleting -> gone exactly once."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

DRIVER = "gpu.flexgpu.dev"
API = "gpu.flexgpu.dev/v1alpha1"
COMMAND = "echo DONE; sleep 3600"


def _exactly(device_class: str, **extra: Any) -> dict[str, Any]:
    return {"name": "gpu", "exactly": {"deviceClassName": device_class, **extra}}


def _mig(profile: str) -> dict[str, Any]:
    cel = f'device.attributes["{DRIVER}"].profile == "{profile}"'
    return {"requests": [_exactly("mig.flexgpu.dev", selectors=[{"cel": {"expression": cel}}])]}


def _sharing(sharing: dict[str, Any]) -> dict[str, Any]:
    return {
        "requests": [_exactly("gpu.flexgpu.dev")],
        "config": [
            {
                "opaque": {
                    "driver": DRIVER,
                    "parameters": {"apiVersion": API, "kind": "GpuConfig", "sharing": sharing},
                }
            }
        ],
    }


@dataclass(frozen=True)
class Kind:
    name: str
    node: str
    devices: dict[str, Any]
    # How many of this kind may exist at once: the node never runs out of hardware for all.
    limit: int


def kinds(whole: str, mig: str, shared: str) -> list[Kind]:
    return [
        Kind("whole", whole, {"requests": [_exactly("gpu.flexgpu.dev")]}, 3),
        Kind(
            "nvlink-pair",
            whole,
            {
                "requests": [_exactly("gpu.flexgpu.dev", count=2)],
                "constraints": [{"requests": ["gpu"], "matchAttribute": f"{DRIVER}/nvlinkDomain"}],
            },
            1,
        ),
        Kind("mig-1g", mig, _mig("1g.10gb"), 4),
        Kind("mig-3g", mig, _mig("3g.40gb"), 2),
        Kind(
            "mps-fraction",
            shared,
            {
                "requests": [
                    _exactly("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "16Gi"}})
                ]
            },
            3,
        ),
        Kind(
            "mps-gpu",
            shared,
            _sharing(
                {
                    "strategy": "MPS",
                    "mpsConfig": {
                        "defaultActiveThreadPercentage": 50,
                        "defaultPinnedDeviceMemoryLimit": "10Gi",
                    },
                }
            ),
            1,
        ),
        Kind(
            "time-sliced",
            shared,
            _sharing({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}}),
            2,
        ),
    ]


@dataclass
class Workload:
    name: str
    kind: Kind
    stage: str = "claim"  # claim -> pod -> deleting -> gone
    created_at: float = 0.0
    running_since: float | None = None
    lifetime_s: float = 0.0
    delete_sent_at: float | None = None


@dataclass
class ChurnCounts:
    created: Counter[str] = field(default_factory=Counter)
    ran: Counter[str] = field(default_factory=Counter)
    never_ran: Counter[str] = field(default_factory=Counter)
    api_errors: int = 0


class Churn:
    def __init__(
        self,
        api: Any,
        namespace: str,
        all_kinds: list[Kind],
        rng: random.Random,
        pending_timeout_s: float = 120.0,
        life_s: tuple[float, float] = (5.0, 25.0),
    ) -> None:
        self.core = client.CoreV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self.namespace = namespace
        self.kinds = all_kinds
        self.rng = rng
        self.pending_timeout_s = pending_timeout_s
        self.life_s = life_s
        self.workloads: list[Workload] = []
        self.counts = ChurnCounts()
        self._serial = 0

    def active(self) -> list[Workload]:
        return [w for w in self.workloads if w.stage != "gone"]

    def tick(self, create: bool) -> None:
        """One step: at most one new workload, then every workload moves on if it can."""
        if create:
            free = [k for k in self.kinds if sum(1 for w in self.active() if w.kind == k) < k.limit]
            if free:
                kind = self.rng.choice(free)
                self._serial += 1
                self.workloads.append(
                    Workload(f"{kind.name}-{self._serial}", kind, created_at=time.monotonic())
                )
                self.counts.created[kind.name] += 1
        try:
            phases = {
                p.metadata.name: p.status.phase
                for p in self.core.list_namespaced_pod(self.namespace).items
            }
        except Exception:
            self.counts.api_errors += 1
            return
        for w in self.active():
            try:
                self._advance(w, phases)
            except Exception:
                self.counts.api_errors += 1

    def delete_all(self) -> None:
        for w in self.active():
            if w.stage in ("claim", "pod"):
                w.stage = "deleting"

    def _advance(self, w: Workload, phases: dict[str, str]) -> None:
        now = time.monotonic()
        if w.stage == "claim":
            body = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": w.name},
                "spec": {"devices": w.kind.devices},
            }
            self._create(
                lambda: self.resource.create_namespaced_resource_claim(self.namespace, body)
            )
            self._create(lambda: self.core.create_namespaced_pod(self.namespace, self._pod(w)))
            w.stage = "pod"
        elif w.stage == "pod":
            phase = phases.get(w.name)
            if phase == "Running" and w.running_since is None:
                w.running_since = now
                w.lifetime_s = self.rng.uniform(*self.life_s)
                self.counts.ran[w.kind.name] += 1
            if w.running_since is not None and now - w.running_since > w.lifetime_s:
                w.stage = "deleting"
            elif w.running_since is None and now - w.created_at > self.pending_timeout_s:
                self.counts.never_ran[w.kind.name] += 1
                w.stage = "deleting"
            elif phase in ("Failed", "Succeeded"):
                w.stage = "deleting"
        if w.stage == "deleting":
            if w.name in phases:
                # A terminating pod waits for its unprepare: ask again only now and then.
                if w.delete_sent_at is None or now - w.delete_sent_at > 15:
                    self._delete(lambda: self.core.delete_namespaced_pod(w.name, self.namespace))
                    w.delete_sent_at = now
                return
            # The claim is deleted once its pod is gone; it goes when it is deallocated.
            self._delete(
                lambda: self.resource.delete_namespaced_resource_claim(w.name, self.namespace)
            )
            w.stage = "gone"

    def _pod(self, w: Workload) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": w.name, "labels": {"soak-kind": w.kind.name}},
            "spec": {
                "restartPolicy": "Never",
                "terminationGracePeriodSeconds": 1,
                "nodeSelector": {"kubernetes.io/hostname": w.kind.node},
                "containers": [
                    {
                        "name": "main",
                        "image": "none",
                        "command": ["/bin/sh", "-c", COMMAND],
                        "resources": {"claims": [{"name": "g"}]},
                    }
                ],
                "resourceClaims": [{"name": "g", "resourceClaimName": w.name}],
            },
        }

    @staticmethod
    def _create(call: Any) -> None:
        try:
            call()
        except client.ApiException as err:
            if err.status != 409:  # created by an earlier try whose answer was lost
                raise

    @staticmethod
    def _delete(call: Any) -> None:
        try:
            call()
        except client.ApiException as err:
            if err.status != 404:
                raise
