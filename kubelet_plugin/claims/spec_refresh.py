"""Prepared claims' CDI specs brought to the driver installed now.

A spec carries the driver's common edits (libraries by their versioned names, programs,
hooks) at spec level; after the driver under the driver root changes, a container that starts
from an old spec (a new pod's, or a restarted one of a running pod) would be handed files that
no longer exist. Each prepared claim's spec is rewritten with the new edits, its devices kept.

Crash-safe by being a convergence, not a sequence: each spec is replaced atomically (old or
new, never torn), a spec already current is left alone, and start-up runs the same refresh
with the edits it generated, so a SIGKILL anywhere leaves specs that a restart finishes.
Concurrent with prepare and unprepare of other claims: each claim is rewritten under its own
claim lock (the lock a prepare or unprepare of it holds throughout), inside the shared node
lock (so never during start-up reconcile).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from flexgpu.driver.atomic_file import atomic_write_bytes
from flexgpu.driver.cdi import encode_spec, with_driver_edits
from flexgpu.driver.log_format import claim_fields
from flexgpu.kubelet_plugin.claims.checkpoint import CheckpointStore
from flexgpu.kubelet_plugin.claims.checkpoint_records import ClaimState
from flexgpu.kubelet_plugin.claims.prepare_lock import PrepareLock

log = logging.getLogger(__name__)


class SpecOwner(Protocol):
    """What a refresh needs of the preparer (ClaimPreparerImpl is one)."""

    driver_edits: dict[str, Any]

    @property
    def store(self) -> CheckpointStore: ...

    @property
    def lock(self) -> PrepareLock: ...

    def step(self, step: str, uid: str) -> None: ...


@dataclass
class RefreshReport:
    rewritten: list[str] = field(default_factory=list)  # claim UIDs
    current: list[str] = field(default_factory=list)  # already had these edits
    # Claim UID -> why: not written (a full disk...): retried, prepares wait meanwhile.
    failed: dict[str, str] = field(default_factory=dict)
    # Claim UID -> why: no spec to rewrite (gone, not JSON): left as it is, nothing waits on it.
    unusable: dict[str, str] = field(default_factory=dict)


def refresh_specs(owner: SpecOwner, edits: Mapping[str, Any]) -> RefreshReport:
    """Makes ``edits`` the preparer's driver edits, then rewrites every prepared claim's spec
    that carries others. The edits change first: a prepare already past the point where it
    could be refused either wrote its spec before that (its record is then listed below and
    rewritten) or writes it with the new edits."""
    owner.driver_edits = dict(edits)
    report = RefreshReport()
    with owner.lock.operation():
        for uid in sorted(owner.store.checkpoint().claims):
            with owner.lock.claim(uid):
                _refresh_one(owner, uid, edits, report)
    return report


def _refresh_one(
    owner: SpecOwner, uid: str, edits: Mapping[str, Any], report: RefreshReport
) -> None:
    record = owner.store.get(uid)  # now, under the claim lock: it may have been unprepared
    if record is None or record.state != ClaimState.PREPARED:
        return  # gone, or half-done: its retry or start-up reconcile writes or removes it
    path = record.created.cdi_spec_path
    if path is None:
        return  # no device of ours: no spec
    fields = claim_fields(record.namespace, record.name, uid)
    try:
        with open(path, "rb") as f:
            spec = json.loads(f.read())
        if not isinstance(spec, dict):
            raise ValueError(f"holds {type(spec).__name__}, not a CDI spec")
        updated = with_driver_edits(spec, edits)
    except (OSError, ValueError) as err:
        # Not a driver matter: a container handed this spec fails whatever the driver, and
        # a stale one must not hold every other prepare on the node. Left for the kubelet's
        # next prepare of the claim (after its unprepare) and start-up reconcile.
        log.error(
            "CDI spec %s of claim %s/%s cannot be read to rewrite it: %s",
            path,
            record.namespace,
            record.name,
            err,
            extra=fields,
        )
        report.unusable[uid] = str(err)
        return
    if updated == spec:
        report.current.append(uid)
        return
    try:
        owner.step("spec-refresh-before-write", uid)
        atomic_write_bytes(path, encode_spec(updated), sync_directory=False)
        owner.step("spec-refresh-written", uid)
    except OSError as err:
        log.error(
            "CDI spec %s of claim %s/%s not rewritten: %s",
            path,
            record.namespace,
            record.name,
            err,
            extra=fields,
        )
        report.failed[uid] = str(err)
        return
    log.info(
        "CDI spec of claim %s/%s rewritten for the driver installed now",
        record.namespace,
        record.name,
        extra=fields,
    )
    report.rewritten.append(uid)
