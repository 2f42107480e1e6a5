"""Opaque configs addressed to a driver that never reads them.

A claim half migrated from NVIDIA's DRA driver keeps `opaque.driver: gpu.nvidia.com` on a
config while its requests already ask for flexgpu's classes. Kubernetes hands each config only
to the driver it names, so neither driver reads it and the claim would run without the sharing
or MIG settings its author wrote. Admission refuses such a config (where every request it can
apply to is served by flexgpu), naming the fix; a config for a request of NVIDIA's class, or of
any other driver's, is none of flexgpu's business and passes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME

# The driver names of configs flexgpu reads under its own name (same kinds and fields).
MIGRATED_DRIVERS: Final = frozenset({"gpu.nvidia.com"})
# The chart's DeviceClasses are all named <what>.flexgpu.dev (gpu, shared-gpu, mig, and
# mig-<profile> for extended resources).
OUR_CLASS_SUFFIX: Final = f".{DRIVER_NAME.partition('.')[2]}"


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: object) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def request_classes(requests: object) -> dict[str, set[str]]:
    """Each request reference a config may name (``req`` and ``req/sub``) -> the DeviceClasses
    it can be served from; malformed parts are skipped (the apiserver reports them)."""
    out: dict[str, set[str]] = {}
    for raw in _list(requests):
        request = _mapping(raw)
        name = request.get("name")
        if not isinstance(name, str):
            continue
        exactly = _mapping(request.get("exactly"))
        if exactly:
            out[name] = {str(exactly.get("deviceClassName"))}
        for raw_sub in _list(request.get("firstAvailable")):
            sub = _mapping(raw_sub)
            if isinstance(sub.get("name"), str):
                device_class = str(sub.get("deviceClassName"))
                out[f"{name}/{sub['name']}"] = {device_class}
                out.setdefault(name, set()).add(device_class)
    return out


def misaddressed_configs(devices: object, *, path: str) -> list[str]:
    """Problems for configs of ``devices`` (a claim spec's ``devices``) that name NVIDIA's
    driver on requests only flexgpu serves; ``path`` names ``devices`` in the object."""
    body = _mapping(devices)
    classes = request_classes(body.get("requests"))
    problems = []
    for index, raw in enumerate(_list(body.get("config"))):
        entry = _mapping(raw)
        driver = _mapping(entry.get("opaque")).get("driver")
        if driver not in MIGRATED_DRIVERS:
            continue
        named = [str(r) for r in _list(entry.get("requests"))] or list(classes)
        served = set().union(*(classes.get(n, set()) for n in named)) if named else set()
        if not served or not all(c.endswith(OUR_CLASS_SUFFIX) for c in served):
            continue
        problems.append(
            f"{path}.config[{index}].opaque.driver: {driver!r} is read by no driver here: "
            f"request(s) {', '.join(named)} ask for {', '.join(sorted(served))}, served by "
            f"{DRIVER_NAME}, which reads the same kinds (GpuConfig, MigDeviceConfig, ...) only "
            f"under driver {DRIVER_NAME!r}; set opaque.driver to {DRIVER_NAME!r}"
        )
    return problems
