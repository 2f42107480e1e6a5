"""IdleGpuClaim Events on claims whose GPUs do nothing, and on the pods that hold them.

The plugins measure (``flexgpu_claim_idle_seconds``: how long every device of the claim has
been below the idle threshold); the leader reads their endpoints every interval and tells
the claim and each pod using it once per idle stretch. The controller does this rather than
the plugins because it already records Events on pods and claims cluster-wide and knows
which pods use a claim (the claim's ``status.reservedFor``, read when it turns idle), while a
plugin may only record Events about its own Node.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kubernetes import client

from flexgpu.controller.events import EventSink, EventTarget
from flexgpu.controller.plugin_endpoints import Scrape, scrape
from flexgpu.driver.backoff import Backoff
from flexgpu.driver.claim_consumers import PODGROUP_API_VERSION, Consumer, consumers
from flexgpu.driver.durations import human_duration
from flexgpu.driver.loop import Loop

log = logging.getLogger(__name__)

REASON = "IdleGpuClaim"
IDLE_FAMILY = "flexgpu_claim_idle_seconds"
RETRY_CAP_S = (
    300.0  # longest delay between retries of failing checks (unless the interval is longer)
)


def claim_reader(api: client.ApiClient) -> Callable[[str, str], Mapping[str, Any] | None]:
    """Reads a ResourceClaim as plain JSON; None when it is gone."""
    resource = client.ResourceV1Api(api)

    def read(namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            obj = resource.read_namespaced_resource_claim(name, namespace)
        except client.ApiException as err:
            if err.status == 404:
                return None
            raise
        result: Mapping[str, Any] = api.sanitize_for_serialization(obj)
        return result

    return read


class IdleClaimNotifier:
    def __init__(
        self,
        endpoints: Sequence[str],
        sink: EventSink,
        *,
        read_claim: Callable[[str, str], Mapping[str, Any] | None],
        is_leader: Callable[[], bool],
        window_s: float,
        interval_s: float = 60.0,
        read: Callable[[Sequence[str]], Scrape] = scrape,
    ) -> None:
        self._endpoints = list(endpoints)
        self._sink = sink
        self._read_claim = read_claim
        self._is_leader = is_leader
        self.window_s = window_s
        self._interval_s = interval_s
        self._read = read
        self._told: set[str] = set()  # claim keys told in their current idle stretch
        # The first check one interval after start, then one per interval; a failed check
        # is retried after a jittered delay growing from one interval to five minutes.
        self._loop = Loop(
            "idle-claims",
            self._step,
            interval_s,
            backoff=Backoff(interval_s, max(interval_s, RETRY_CAP_S)),
            first_run_s=interval_s,
        )

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    @property
    def running(self) -> bool:
        return self._loop.running

    @property
    def last_error(self) -> str | None:
        """Why the last check failed; None after one that worked."""
        return self._loop.last_error

    def _step(self) -> None:
        if not self._is_leader():
            self._told.clear()  # a later leadership starts afresh
            return
        self.check_once()  # its keys are not returned: Loop would read them as the next wait

    def check_once(self) -> list[str]:
        """Tells newly idle claims and their pods; returns the keys told this time."""
        idle: dict[str, tuple[float, set[str]]] = {}
        for sample in self._read(self._endpoints).named(IDLE_FAMILY):
            key = f"{sample.labels.get('namespace', '')}/{sample.labels.get('claim', '')}"
            seconds, nodes = idle.get(key, (float("inf"), set()))
            # Idle only if idle on every node that reports the claim.
            idle[key] = (min(seconds, sample.value), nodes | {sample.labels.get("node", "")})
        self._told &= {k for k, (s, _) in idle.items() if s >= self.window_s}
        told = []
        for key, (seconds, nodes) in sorted(idle.items()):
            if seconds < self.window_s or key in self._told:
                continue
            namespace, _, name = key.partition("/")
            try:
                obj = self._read_claim(namespace, name)
            except Exception as err:  # try again next round
                log.warning("cannot read claim %s: %s", key, err)
                continue
            if not obj:
                continue  # deleted meanwhile
            meta, status = obj.get("metadata") or {}, obj.get("status") or {}
            # Running pods are not in the controller's cache (it keeps pods waiting for a
            # node); the claim's status names the pods using it, or their PodGroup.
            targets = [
                EventTarget(
                    "ResourceClaim", "resource.k8s.io/v1", namespace, name, str(meta.get("uid", ""))
                )
            ] + [t for c in consumers(status) if (t := _consumer_target(namespace, c))]
            message = (
                f"GPU claim {key} has used less than the idle threshold of its devices' SM "
                f"time for {human_duration(seconds)} (on {', '.join(sorted(nodes))}); release it "
                "if the workload no longer needs a GPU"
            )
            for target in targets:
                self._sink.emit(target, REASON, message, repeat=True)
            self._told.add(key)
            told.append(key)
            log.info(
                "claim %s idle for %s: told it and %d consumer(s)",
                key,
                human_duration(seconds),
                len(targets) - 1,
            )
        return told


def _consumer_target(namespace: str, consumer: Consumer) -> EventTarget | None:
    """A pod, or a gang's PodGroup (whose claim names no member pods): the object people
    look at when they ask why their workload holds an idle GPU. None for a consumer kind this
    code does not know (its Kind cannot be told from reservedFor's plural resource)."""
    if consumer.is_pod_group:
        return EventTarget("PodGroup", PODGROUP_API_VERSION, namespace, consumer.name, consumer.uid)
    if consumer.is_pod:
        return EventTarget("Pod", "v1", namespace, consumer.name, consumer.uid)
    return None
