"""Extended resources in a pod's containers, counted as the scheduler counts them.

With DRAExtendedResource (GA in 1.37), a pod asking `resources.limits: {nvidia.com/gpu: 2}` is
served from the DeviceClass whose `spec.extendedResourceName` is that name (or whose name
follows `deviceclass.resource.kubernetes.io/`), on nodes where no device plugin advertises it.
The scheduler makes the pod's ResourceClaim only when it binds the pod, so a pending pod has
no claim to explain: the diagnostics explain one built from these counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# Every DeviceClass also serves this name + its own name (DRAExtendedResource).
IMPLICIT_PREFIX: Final = "deviceclass.resource.kubernetes.io/"


def is_extended(name: str) -> bool:
    """An extended resource name: domain-qualified, not in the kubernetes.io domains (which
    hold the native resources) and not a quota name (``requests.``)."""
    domain, sep, _ = name.partition("/")
    if not sep or name.startswith("requests."):
        return False
    return not (domain == "kubernetes.io" or domain.endswith(".kubernetes.io")) or (
        name.startswith(IMPLICIT_PREFIX)
    )


def _count(container: object) -> dict[str, int]:
    if not isinstance(container, Mapping):
        return {}
    resources = container.get("resources")
    resources = resources if isinstance(resources, Mapping) else {}
    out: dict[str, int] = {}
    for part in ("requests", "limits"):  # limits win: for extended resources they must match
        values = resources.get(part)
        for name, value in values.items() if isinstance(values, Mapping) else ():
            if isinstance(name, str) and is_extended(name):
                try:
                    out[name] = int(str(value))
                except ValueError:
                    continue  # the apiserver admits whole numbers only
    return out


def extended_resources(spec: Mapping[str, Any]) -> dict[str, int]:
    """Name -> count for the pod: the sum over its containers, or the largest count of one
    init container when that is more (init containers run one at a time)."""
    total: dict[str, int] = {}
    for container in spec.get("containers") or ():
        for name, count in _count(container).items():
            total[name] = total.get(name, 0) + count
    for container in spec.get("initContainers") or ():
        for name, count in _count(container).items():
            total[name] = max(total.get(name, 0), count)
    return {name: count for name, count in total.items() if count > 0}


def class_for(name: str, classes: Mapping[str, str]) -> str | None:
    """The DeviceClass that serves extended resource ``name``; ``classes`` maps each class's
    ``extendedResourceName`` to the class (explicit names win over the implicit ones)."""
    explicit = classes.get(name)
    if explicit is not None:
        return explicit
    if name.startswith(IMPLICIT_PREFIX):
        return name[len(IMPLICIT_PREFIX) :] or None
    return None
