"""Small builders for API-shaped dicts, parsed into the allocation model."""

from __future__ import annotations

from typing import Any

from flexgpu.driver.allocation import (
    DeviceClass,
    Node,
    ResourceClaim,
    ResourceSlice,
    parse_claim,
    parse_device_class,
    parse_slice,
)

DRIVER = "gpu.example.com"
CLASS = "gpu"


def attrs(**values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, bool):
            out[key] = {"bool": value}
        elif isinstance(value, int):
            out[key] = {"int": value}
        elif isinstance(value, str) and value.startswith("v"):
            out[key] = {"version": value[1:]}
        else:
            out[key] = {"string": value}
    return out


def device(name: str, memory: str = "40Gi", **values: Any) -> dict[str, Any]:
    return {"name": name, "attributes": attrs(**values), "capacity": {"memory": {"value": memory}}}


def pool_slices(
    node: str,
    devices: list[dict[str, Any]],
    *,
    counters: list[dict[str, Any]] | None = None,
    generation: int = 1,
    count: int | None = None,
    driver: str = DRIVER,
    extra: dict[str, Any] | None = None,
) -> list[ResourceSlice]:
    total = count if count is not None else 1 + (1 if counters else 0)
    pool = {"name": node, "generation": generation, "resourceSliceCount": total}
    where = extra if extra is not None else {"nodeName": node}
    out = []
    if counters:
        body = {"driver": driver, "pool": pool, "sharedCounters": counters, **where}
        out.append(parse_slice({"metadata": {"name": f"{node}-counters"}, "spec": body}))
    body = {"driver": driver, "pool": pool, "devices": devices, **where}
    out.append(parse_slice({"metadata": {"name": f"{node}-devices-{generation}"}, "spec": body}))
    return out


def device_class(name: str = CLASS, *selectors: str) -> dict[str, DeviceClass]:
    exprs = (f'device.driver == "{DRIVER}"', *selectors)
    body = {"spec": {"selectors": [{"cel": {"expression": e}} for e in exprs]}}
    return {name: parse_device_class({"metadata": {"name": name}, **body})}


def request(name: str = "r", count: int = 1, *selectors: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"deviceClassName": CLASS, "count": count, **extra}
    if selectors:
        body["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": body}


def claim(
    *requests: dict[str, Any],
    constraints: list[dict[str, Any]] | None = None,
    name: str = "c",
    results: list[dict[str, Any]] | None = None,
) -> ResourceClaim:
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {"devices": {"requests": list(requests), "constraints": constraints or []}},
    }
    if results is not None:
        body["status"] = {"allocation": {"devices": {"results": results}}}
    return parse_claim(body)


def holding(name: str, *devices: str, node: str = "n1", **extra: Any) -> ResourceClaim:
    """A claim that already holds ``devices`` of ``node``'s pool."""
    results = [
        {"request": "r", "driver": DRIVER, "pool": node, "device": d, **extra} for d in devices
    ]
    return claim(request(), name=name, results=results)


NODE = Node("n1", {"kubernetes.io/hostname": "n1", "zone": "a"})
