"""Who a ResourceClaim is reserved for (``status.reservedFor``), read once for the plugin and
the controller.

Entries are not always Pods: with gang scheduling and claims for PodGroups (Kubernetes 1.36+,
``DRAWorkloadResourceClaims``) the scheduler reserves a group's claim for the PodGroup
(``scheduling.k8s.io``, resource ``podgroups``) and never lists the member pods; the kubelet
accepts a pod whose ``spec.schedulingGroup.podGroupName`` names that group. Code that wants
the claim's pods must therefore say what it does with a group, not drop the entry unseen."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

SCHEDULING_GROUP: Final = "scheduling.k8s.io"
# The version Events name a PodGroup by: the one 1.37 serves (beta). reservedFor carries only
# the group, and an Event's involvedObject is a reference for readers, not a lookup.
PODGROUP_API_VERSION: Final = "scheduling.k8s.io/v1beta1"


@dataclass(frozen=True)
class Consumer:
    """One ``status.reservedFor`` entry."""

    api_group: str
    resource: str
    name: str
    uid: str

    @property
    def is_pod(self) -> bool:
        return self.api_group == "" and self.resource == "pods"

    @property
    def is_pod_group(self) -> bool:
        return self.api_group == SCHEDULING_GROUP and self.resource == "podgroups"

    @property
    def label(self) -> str:
        """How people read it: a pod by its name, anything else as ``resource.group/name``
        (``podgroups.scheduling.k8s.io/train``), so a group is never taken for a pod."""
        if self.is_pod:
            return self.name
        group = f".{self.api_group}" if self.api_group else ""
        return f"{self.resource}{group}/{self.name}"


def consumers(status: Mapping[str, Any] | None) -> tuple[Consumer, ...]:
    """The claim's consumers in the order the server lists them; malformed entries (not an
    object) are skipped, as the server never writes them."""
    entries: Iterable[Any] = (status or {}).get("reservedFor") or []
    return tuple(
        Consumer(
            api_group=str(entry.get("apiGroup") or ""),
            resource=str(entry.get("resource") or ""),
            name=str(entry.get("name") or ""),
            uid=str(entry.get("uid") or ""),
        )
        for entry in entries
        if isinstance(entry, Mapping)
    )
