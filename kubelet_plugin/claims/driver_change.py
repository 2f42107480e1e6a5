"""The claim pipeline's "driver-change" stage: no spec is written for a driver that is gone.

NVIDIA's GPU Operator upgrades the driver in place (its driver container reloads the kernel
module and replaces the files under the driver root). The plugin's driver edits name the
libraries by version, so after a change every spec written from them would hand containers
files that no longer exist. This stage reads the driver root's fingerprint on each prepare (a
few system calls, driver/driver_version.py); while it differs from the one the edits were
generated for, each claim of the call is refused with an error naming the old and the new
version, which the kubelet retries, and the driver watch (agents/driver_watch.py) is woken to
``settle``: generate the new edits, refresh every prepared claim's spec (spec_refresh.py),
and only then take the new fingerprint as current, which lets prepares through again.
Unprepares always pass: they only remove.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from flexgpu.driver.driver_version import DriverFingerprint, read_fingerprint, version_of
from flexgpu.kubelet_plugin.claims.pipeline import PREPARE, Call, R, Step
from flexgpu.kubelet_plugin.claims.spec_refresh import RefreshReport, SpecOwner, refresh_specs
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

log = logging.getLogger(__name__)

# Reasons of the Node Events (Warning when the change is seen, Normal once specs follow it).
CHANGED_REASON = "DriverChanged"
REGENERATED_REASON = "DriverSpecsRegenerated"
FAILED_REASON = "DriverSpecsNotRegenerated"

# (reason, message, event type): how the stage records a Node Event.
EventSink = Callable[[str, str, str], None]


class DriverChange:
    """The stage, and the one place that decides which driver specs are written for."""

    name = "driver-change"

    def __init__(
        self,
        driver_root: Path,
        current: DriverFingerprint | None,
        owner: SpecOwner,
        generate: Callable[[], Mapping[str, Any]],
        *,
        events: EventSink | None = None,
        on_settled: Callable[[str, int], None] | None = None,
    ) -> None:
        self._root = driver_root
        # What the owner's edits were generated from; replaced only once specs follow it.
        self._current = current
        self._owner = owner
        self._generate = generate
        self._events = events
        # (result "ok" or "error", specs rewritten): the metric, when metrics are on.
        self.on_settled = on_settled
        # Called with a new driver's edits once prepared specs follow them (MPS daemon pods).
        self.on_edits: Callable[[Mapping[str, Any]], None] | None = None
        self._settling = threading.Lock()
        self._announced: DriverFingerprint | None = current
        self._last_error = ""
        # Called by a refused prepare, so the watch settles now rather than at its next poll.
        self.wake: Callable[[], None] = lambda: None

    @classmethod
    def at_start(
        cls,
        driver_root: Path | None,
        installed: DriverFingerprint | None,
        owner: SpecOwner,
        generate: Callable[[], Mapping[str, Any]],
        *,
        events: EventSink | None = None,
        on_settled: Callable[[str, int], None] | None = None,
    ) -> DriverChange | None:
        """The stage at plugin start, once start-up reconcile is done (None without a driver
        root): the owner's edits were just generated from ``installed``; prepared specs are
        brought to them first, which finishes a refresh that a SIGKILL cut short."""
        if driver_root is None:
            return None
        report = refresh_specs(owner, owner.driver_edits)
        if report.rewritten:
            log.info(
                "start-up: %d prepared CDI spec(s) rewritten for driver %s",
                len(report.rewritten),
                version_of(installed),
            )
        return cls(driver_root, installed, owner, generate, events=events, on_settled=on_settled)

    @property
    def current(self) -> DriverFingerprint | None:
        return self._current

    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]:
        if call is PREPARE:
            why = self.refusal()
            if why is not None:
                return {c.uid: call.failed(why) for c in claims}
        return next_step(claims)

    def refusal(self) -> str | None:
        """Why prepares are refused now, or None when the specs follow the driver."""
        found = read_fingerprint(self._root)
        if found == self._current:
            return None
        self.wake()
        why = (
            f"the NVIDIA driver under {self._root} changed from {version_of(self._current)} "
            f"to {version_of(found)}; CDI specs are being regenerated for it, retry"
        )
        if self._last_error:
            why += f" (last attempt: {self._last_error})"
        return why

    def settle(self) -> bool:
        """Brings the edits and every prepared spec to the driver installed now; True when
        they follow it (or already did). One at a time; a failure is retried by the next."""
        with self._settling:
            found = read_fingerprint(self._root)
            if found == self._current:
                return True
            old = self._current
            self._announce(old, found)
            if found is None:
                return False  # a root half-way through a swap: nothing to generate from
            try:
                edits = self._generate()
            except Exception as err:  # the generator over a root still being written
                return self._failed(old, found, f"generating the driver's CDI edits: {err}")
            report = refresh_specs(self._owner, edits)
            if self.on_edits is not None:
                self.on_edits(edits)
            if read_fingerprint(self._root) != found:
                return False  # changed again meanwhile: the next settle starts over
            if report.failed:
                listed = ", ".join(f"{uid}: {why}" for uid, why in sorted(report.failed.items()))
                return self._failed(old, found, f"specs not rewritten: {listed}")
            self._current = found
            self._last_error = ""
            self._settled(old, found, report)
            return True

    def _announce(self, old: DriverFingerprint | None, found: DriverFingerprint | None) -> None:
        if found == self._announced:
            return
        self._announced = found
        message = (
            f"NVIDIA driver under {self._root} changed from {version_of(old)} to "
            f"{version_of(found)}: prepares wait until every prepared claim's CDI spec names "
            "the new driver's files"
        )
        log.warning("%s", message)
        self._event(CHANGED_REASON, message, "Warning")

    def _failed(self, old: DriverFingerprint | None, found: DriverFingerprint, why: str) -> bool:
        if why != self._last_error:
            log.error("driver %s: %s", found.version, why)
            self._event(
                FAILED_REASON,
                f"driver {version_of(old)} -> {found.version}: {why}; retrying",
                "Warning",
            )
            if self.on_settled is not None:
                self.on_settled("error", 0)
        self._last_error = why
        return False

    def _settled(
        self, old: DriverFingerprint | None, found: DriverFingerprint, report: RefreshReport
    ) -> None:
        message = (
            f"CDI specs follow NVIDIA driver {found.version} (was {version_of(old)}): "
            f"{len(report.rewritten)} prepared claim spec(s) rewritten, "
            f"{len(report.current)} already current; prepares go on"
        )
        if report.unusable:
            listed = ", ".join(f"{uid} ({why})" for uid, why in sorted(report.unusable.items()))
            message += f"; specs that cannot be read, left as they are: {listed}"
        log.info("%s", message)
        self._event(REGENERATED_REASON, message, "Normal")
        if self.on_settled is not None:
            self.on_settled("ok", len(report.rewritten))

    def _event(self, reason: str, message: str, event_type: str) -> None:
        if self._events is not None:
            self._events(reason, message, event_type)
