"""Keeps this node's ResourceSlices equal to what the plugin wants published.

The kubelet deletes a driver's slices when it starts and 30 s after the plugin disconnects,
and anyone with RBAC can edit them, so publishing is a reconcile loop (a driver.loop.Loop):
a watch on our own slices wakes it, a periodic resync catches missed events, and API errors
back off instead of spinning.

The apiserver can go away (restart, upgrade, network): while it cannot be reached, both loops
retry every 2 s at most (jittered, so a fleet of nodes does not reconnect in step), and every
(re)connected watch starts with a list that also wakes a reconcile, so whatever changed while
nobody watched is repaired within seconds of the server answering again. Errors the server
answers with (a refused write) back off to 30 s. Every call has a client-side timeout, so no
dead connection can stall either loop.

It talks to the server through kubelet_plugin.api.kube_api (plain dicts), not the official client,
whose import alone costs the plugin about 7 MiB.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import re
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from flexgpu.driver.backoff import Backoff
from flexgpu.driver.loop import Loop
from flexgpu.driver.names import DRIVER_NAME
from flexgpu.driver.quantity import QuantityError, parse_quantity
from flexgpu.driver.resource_slice import SliceDevice, slice_specs
from flexgpu.kubelet_plugin.api.kube_api import ApiError, KubeApi, WatchStream, path_of
from flexgpu.kubelet_plugin.api.watch_pacing import MAX_RETRY_AFTER_S, WatchPacer

log = logging.getLogger(__name__)

RESYNC_INTERVAL_S = 30.0
RAPID_WRITES = 10
RAPID_WINDOW_S = 10.0
RAPID_PAUSE_S = 5.0
MAX_BACKOFF_S = 30.0
# While the server cannot be reached: retry soon, so slices are back seconds after it is.
FIRST_RETRY_S = 0.2
UNREACHABLE_RETRY_CAP_S = 2.0
# Server-side watch length; KubeApi's read timeout adds a margin so only a dead stream trips it.
WATCH_TIMEOUT_S = 20
SLICES = path_of("apis", "resource.k8s.io", "v1", "resourceslices")


# Fields holding quantities: the server writes them back in canonical form ("40960Mi" comes
# back as "40Gi"), so they compare by value, not by text.
_QUANTITY_KEYS = frozenset({"value", "default", "min", "max", "step", "validValues"})


# A device's fields the plugin alone sets and the server never defaults: one the plugin no
# longer sets (binding conditions once a GPU's tenant is published or the feature is off, a
# taint cleared, a share setting) must be gone from the server too, or a restarted plugin would
# leave it there forever.
_OWNED_DEVICE_KEYS = frozenset(
    {
        "bindingConditions",
        "bindingFailureConditions",
        "bindsToNode",
        "taints",
        "allowMultipleAllocations",
        "consumesCounters",
    }
)
# Maps whose entries are all the plugin's: the same names on both sides.
_EXACT_MAPS = frozenset({"attributes", "capacity"})


def contains(actual: Any, desired: Any, key: str = "") -> bool:
    """True when every field we set is present and equal in what the server holds (the server
    may add defaults; lists must match element by element), and no device field or map entry
    we own is there that we no longer set."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return False
        if key in _EXACT_MAPS and actual.keys() != desired.keys():
            return False
        if key == "devices" and any(actual.get(k) and k not in desired for k in _OWNED_DEVICE_KEYS):
            return False
        return all(k in actual and contains(actual[k], v, k) for k, v in desired.items())
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(actual) == len(desired)
            and all(contains(a, d, key) for a, d in zip(actual, desired, strict=True))
        )
    if key in _QUANTITY_KEYS and isinstance(actual, str) and isinstance(desired, str):
        return _same_quantity(actual, desired)
    return bool(actual == desired)


def _same_quantity(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return parse_quantity(a).value == parse_quantity(b).value
    except QuantityError:
        return False


def _up_to_date(current: dict[str, Any] | None, spec: Any, owner: dict[str, Any]) -> bool:
    """Whether a slice on the server has ``spec`` and is owned by this node's Node."""
    return (
        current is not None
        and contains(current.get("spec"), spec)
        and any(
            o.get("uid") == owner["uid"] for o in current["metadata"].get("ownerReferences") or []
        )
    )


def unreachable(err: BaseException) -> bool:
    """True when the error says the server could not be reached or is not serving yet (so
    retrying soon is right), False when it answered and refused (back off)."""
    if isinstance(err, ApiError):
        return err.status in (408, 429) or err.status >= 500
    return isinstance(err, OSError | http.client.HTTPException)


def new_backoff(rng: random.Random | None = None) -> Backoff:
    """Doubling from ``FIRST_RETRY_S`` up to ``MAX_BACKOFF_S``, jittered (see retry_delay)."""
    return Backoff(FIRST_RETRY_S, MAX_BACKOFF_S, rng)


def retry_delay(backoff: Backoff, err: BaseException) -> float:
    """The next delay, capped at ``UNREACHABLE_RETRY_CAP_S`` while the server is unreachable
    (so slices are back seconds after it is) and at ``MAX_BACKOFF_S`` when it refused."""
    return backoff.next(retry_cap_s(err))


def retry_cap_s(err: BaseException) -> float | None:
    """A lower cap for one retry's delay while the server is away; None: the usual one."""
    return UNREACHABLE_RETRY_CAP_S if unreachable(err) else None


class SlicePublisher:
    """Publishes one pool (named after the node) of driver ``gpu.flexgpu.dev`` devices."""

    def __init__(self, api: KubeApi, node_name: str, resync_interval_s: float = RESYNC_INTERVAL_S):
        self._api = api
        self.node_name = node_name
        self._resync_interval_s = resync_interval_s
        self._lock = threading.Lock()
        self._devices: list[SliceDevice] = []
        self._counters: list[dict[str, Any]] = []
        self._generation = 0
        # publish_again: the next pass writes every slice under a new generation.
        self._bump = False
        self._content_key: str | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._reconciler = self._new_reconciler()
        self._writes: deque[float] = deque(maxlen=RAPID_WRITES)
        self._stream: WatchStream | None = None
        self._node_uid: str | None = None
        self._own_counter_slices: bool | None = None
        self.reconciles = 0  # count of reconcile passes that wrote something, for tests

    # -- public API --------------------------------------------------------------------
    def set_devices(
        self, devices: Sequence[SliceDevice], shared_counters: Sequence[dict[str, Any]] = ()
    ) -> None:
        """Replaces the desired content; the next pass writes what changed (``_generation_for``
        says whether the pool's generation is bumped)."""
        key = json.dumps([list(devices), list(shared_counters)], sort_keys=True)
        with self._lock:
            if key == self._content_key:
                return
            self._devices = list(devices)
            self._counters = list(shared_counters)
            self._content_key = key
        self._reconciler.poke()

    def publish_again(self) -> None:
        """Writes every slice of the pool again under a new generation, content unchanged.

        The scheduler retries the pods it found unschedulable on any ResourceSlice update
        and on little else: the binding watch asks for this once the pods it told
        TenantReady have left the scheduler's PreBind (binding_watch.REQUEUE_AFTER_S)."""
        with self._lock:
            if self._content_key is None:
                return
            self._bump = True
        self._reconciler.poke()

    @property
    def last_error(self) -> str | None:
        """Why the last reconcile pass failed; None after one that worked."""
        return self._reconciler.last_error

    @property
    def published(self) -> bool:
        """True once a reconcile pass went through (the node's slices are as wanted)."""
        return self._reconciler.passes > 0

    @property
    def failures(self) -> int:
        """Failed reconcile passes in all, for the plugin's metrics."""
        return self._reconciler.failures

    def start(self) -> None:
        self._stop.clear()
        self._reconciler.start()  # the same Loop again after a stop: no poke is lost
        # The watch blocks in a streaming read that stop() ends by closing the stream, not
        # a periodic step, so it keeps a thread of its own rather than a Loop.
        thread = threading.Thread(target=self._watch_loop, name="slice-watch", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()  # ends a watch now instead of at its timeout
        self._reconciler.stop(timeout_s=5)
        for thread in self._threads:
            thread.join(timeout=5)
        self._threads.clear()

    def delete_all(self) -> None:
        """Removes every slice of ours on this node (used on uninstall, never on restart)."""
        for item in self._list():
            self._delete(item["metadata"]["name"])

    # -- reconcile ---------------------------------------------------------------------
    def _new_reconciler(self) -> Loop:
        # Waits a resync interval (or a poke: new devices, a watch event) before the first
        # pass, as the watch's first list pokes it anyway. A failed pass waits out its
        # delay whatever pokes come, since our own writes come back as watch events.
        return Loop(
            "slice-reconcile",
            self._reconcile_step,
            self._resync_interval_s,
            backoff=new_backoff(),
            first_run_s=self._resync_interval_s,
            retry_cap_s=retry_cap_s,
            pokes_end_backoff=False,
        )

    def _reconcile_step(self) -> None:
        if not self.reconcile_once():
            return
        self._writes.append(time.monotonic())
        writes = self._writes
        if len(writes) == RAPID_WRITES and writes[-1] - writes[0] < RAPID_WINDOW_S:
            # Someone keeps changing our slices, or the server keeps what we write in
            # another form: do not fight it in a tight loop.
            log.error(
                "slices rewritten %d times in %.0fs; slowing down", RAPID_WRITES, RAPID_WINDOW_S
            )
            writes.clear()
            self._reconciler.hold(RAPID_PAUSE_S)

    def _counters_in_own_slice(self) -> bool:
        """Kubernetes 1.35 moved shared counters into slices of their own; ask once."""
        if self._own_counter_slices is None:
            version = self._api.get("/version")
            minor = re.match(r"\d+", str(version.get("minor", "")))
            self._own_counter_slices = minor is None or int(minor.group()) >= 35
        return self._own_counter_slices

    def _slice_name(self, i: int) -> str:
        return f"{self.node_name}-{DRIVER_NAME}-{i}"

    def _owner(self) -> dict[str, Any]:
        if self._node_uid is None:
            node = self._api.get(path_of("api", "v1", "nodes", self.node_name))
            self._node_uid = str(node["metadata"]["uid"])
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "name": self.node_name,
            "uid": self._node_uid,
            "controller": True,
        }

    def _selector(self) -> str:
        return f"spec.nodeName={self.node_name},spec.driver={DRIVER_NAME}"

    def _list_raw(self) -> dict[str, Any]:
        return self._api.get(SLICES, {"fieldSelector": self._selector()})

    def _list(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self._list_raw().get("items") or []
        return items

    def _delete(self, name: str) -> None:
        try:
            self._api.request("DELETE", f"{SLICES}/{path_of(name)[1:]}")
        except ApiError as err:
            if err.status != 404:
                raise

    def reconcile_once(self) -> bool:
        """Makes the server match the desired slices. Returns True when it wrote anything."""
        with self._lock:
            devices, counters = list(self._devices), list(self._counters)
            if self._content_key is None:
                return False
        existing = {item["metadata"]["name"]: item for item in self._list()}
        owner = self._owner()
        with self._lock:
            bump, self._bump = self._bump, False
        generation = self._generation_for(existing, devices, counters, owner, bump)
        with self._lock:
            self._generation = generation
        wanted = self._wanted(devices, counters, generation)
        wrote = False
        for name, spec in wanted.items():
            current = existing.get(name)
            if _up_to_date(current, spec, owner):
                continue
            body: Any = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": name, "ownerReferences": [owner]},
                "spec": spec,
            }
            if current is None:
                self._api.request("POST", SLICES, body=body)
            else:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                self._api.request("PUT", f"{SLICES}/{path_of(name)[1:]}", body=body)
            wrote = True
        for name in existing.keys() - wanted.keys():
            self._delete(name)
            wrote = True
        if wrote:
            self.reconciles += 1
            log.info(
                "published %d slice(s), generation %d, %d device(s)",
                len(wanted),
                generation,
                len(devices),
            )
        return wrote

    def _wanted(
        self, devices: list[SliceDevice], counters: list[dict[str, Any]], generation: int
    ) -> dict[str, dict[str, Any]]:
        specs = slice_specs(
            self.node_name,
            devices,
            generation,
            counters,
            counters_in_own_slice=self._counters_in_own_slice(),
        )
        return {self._slice_name(i): spec for i, spec in enumerate(specs)}

    def _generation_for(
        self,
        existing: dict[str, dict[str, Any]],
        devices: list[SliceDevice],
        counters: list[dict[str, Any]],
        owner: dict[str, Any],
        bump: bool,
    ) -> int:
        """The pool generation to publish at. Kept (upstream's resourceslice controller does
        the same) when the pool's slices are the same ones, all at one generation, and at
        most one of them changes: one write is atomic, so the scheduler never sees half a
        change, and a tenant or health change of one GPU rewrites one slice, not the pool.
        Bumped otherwise, so slices written one after another are never mixed with the old
        ones; never below what is there (a restarted plugin)."""
        highest = max((i["spec"]["pool"]["generation"] for i in existing.values()), default=0)
        if not existing:
            return max(self._generation, 1) if not bump else self._generation + 1
        if not bump and len({i["spec"]["pool"]["generation"] for i in existing.values()}) == 1:
            wanted = self._wanted(devices, counters, highest)
            changed = [
                n for n, spec in wanted.items() if not _up_to_date(existing.get(n), spec, owner)
            ]
            if wanted.keys() == existing.keys() and len(changed) <= 1:
                return highest
        return max(highest, self._generation) + 1

    # -- watch -------------------------------------------------------------------------
    def _watch_loop(self) -> None:
        backoff = new_backoff()
        # Early ends of watches that did not fail (a proxy cutting them): paced as well.
        pacer = WatchPacer()
        version: str | None = None  # None: list first (start, or after any failure)
        while not self._stop.is_set():
            pacer.opened()
            try:
                if version is None:
                    listed = self._list_raw()
                    version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
                    # Resync: what changed while nobody watched (slices deleted during an
                    # apiserver restart) produces no event on the new watch.
                    self._reconciler.poke()
                    if backoff.failures:
                        log.info("slice watch back after %d failure(s)", backoff.failures)
                    backoff.reset()
                version = self._watch_from(version)
                delay = pacer.ended()
                if delay:
                    log.info("slice watch ended early, reopening in %.1fs", delay)
                    if self._stop.wait(delay):
                        return
            except Exception as err:
                version = None
                if self._stop.is_set():
                    return
                if isinstance(err, ApiError) and err.status == 410:
                    continue  # the version expired (compaction): an ordinary relist
                delay = retry_delay(backoff, err)
                if isinstance(err, ApiError) and err.retry_after_s is not None:
                    delay = max(delay, min(err.retry_after_s, MAX_RETRY_AFTER_S))
                if backoff.failures == 1:
                    log.warning("slice watch failed, retrying in %.1fs: %s", delay, err)
                else:
                    log.info("slice watch still failing, retrying in %.1fs: %s", delay, err)
                if self._stop.wait(delay):
                    return

    def _watch_from(self, version: str) -> str | None:
        """Streams events after ``version`` until the server ends the watch; returns where
        to resume, or ``None`` to list again. Raises on connection and API errors (an
        expired version is an ApiError 410)."""
        query = {
            "fieldSelector": self._selector(),
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
        }
        stream = self._api.watch(SLICES, query, timeout_s=WATCH_TIMEOUT_S)
        self._stream = stream
        resume: str | None = version
        try:
            if self._stop.is_set():
                return None
            for kind, obj in stream:
                resume = (obj.get("metadata") or {}).get("resourceVersion") or resume
                if kind != "BOOKMARK":
                    # Any change to our slices (including our own writes) triggers a cheap
                    # compare; only a real difference leads to a write.
                    self._reconciler.poke()
                if self._stop.is_set():
                    break
        finally:
            self._stream = None
            stream.close()
        return resume
