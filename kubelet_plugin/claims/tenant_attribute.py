"""Each shared GPU's published ``tenant`` follows the node's claim records.

A shared GPU is published with the attribute ``tenant``: the namespace whose claims it
serves, or "" while it is free. Admission adds a selector on it to every request for a
shared GPU (controller/tenant_selector.py), so the scheduler stops offering a GPU that serves
one namespace to another namespace's claims. The value comes from the checkpoint records,
the same records prepare's guard (tenancy.py) reads, after every prepare and unprepare and at
start: a restarted plugin publishes what its records say, and a record rolled back at start
frees its GPU. Publication traffic stays bounded: a call that leaves every value as it was
writes nothing, and the slice publisher folds changes that arrive before its next pass into
one write. Where free shared GPUs carry binding conditions (tenant_binding.py), a GPU is also
held by the namespace of the claims allocated there (``held``), from the moment the plugin
gives it to them, not only once one is prepared.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from flexgpu.kubelet_plugin.claims.checkpoint_records import Checkpoint
from flexgpu.kubelet_plugin.claims.pipeline import Call, R, Step
from flexgpu.kubelet_plugin.claims.prepare_checks import gpu_index_of
from flexgpu.kubelet_plugin.claims.tenancy import tenants_by_gpu
from flexgpu.kubelet_plugin.devices.node_devices import NodeDevices
from flexgpu.kubelet_plugin.kubeletplugin import ClaimRef

__all__ = ["TenantAttribute", "TenantTracking"]

log = logging.getLogger(__name__)


class TenantAttribute:
    """Sets the devices' tenants from the records of ``checkpoint()`` and calls
    ``republish`` when a published value changed. Calls are serialised, so the last one to
    run, which read the newest records, wins over an earlier one that finishes late."""

    def __init__(
        self,
        checkpoint: Callable[[], Checkpoint],
        devices: NodeDevices,
        republish: Callable[[], None],
    ) -> None:
        self._checkpoint = checkpoint
        self._devices = devices
        self._republish = republish
        # GPU index -> the namespace its allocated claims hold it for (binding_watch.py).
        self.held: Callable[[], Mapping[int, str]] = dict
        self._lock = threading.Lock()
        self.changes = 0  # published changes, for tests and the log

    def update(self) -> bool:
        """True when a shared GPU's tenant changed (and was handed to the publisher)."""
        if not self._devices.publish_tenants:
            return False
        with self._lock:
            records = self._checkpoint().claims.values()
            tenants = tenants_by_gpu(records, gpu_index_of(self._devices))
            for index, namespace in self.held().items():
                tenants.setdefault(index, namespace)
            if not self._devices.set_tenants(tenants):
                return False
            self.changes += 1
            self._republish()
        log.info(
            "shared GPUs now serve: %s",
            ", ".join(f"gpu-{i}={ns}" for i, ns in sorted(tenants.items())) or "nobody",
        )
        return True


class TenantTracking:
    """The pipeline stage that updates the tenant attribute (``update``: TenantAttribute's)
    after each prepare and unprepare, also when the call failed part-way (its records are
    what they are). A failure to update is logged, never turned into a failed claim: the
    guard in prepare still holds."""

    name = "tenancy"

    def __init__(self, update: Callable[[], object]) -> None:
        self._update_tenants = update

    def around(
        self, call: Call[R], claims: Sequence[ClaimRef], next_step: Step[R]
    ) -> Mapping[str, R]:
        try:
            return next_step(claims)
        finally:
            self._update(claims)

    def _update(self, claims: Sequence[ClaimRef]) -> None:
        if not claims:
            return  # the kubelet's liveness probe: nothing changed
        try:
            self._update_tenants()
        except Exception:
            log.exception("could not update the shared GPUs' tenant attribute")
