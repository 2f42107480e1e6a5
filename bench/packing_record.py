"""What each step of ``bench.packing_churn`` left on the GPUs, one JSON line per step, so that
a lost large request can be explained afterwards (``bench.packing_lost``): which devices each
placed request holds and which GPUs GPU clearing keeps new claims off at that moment."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kubernetes import client

from flexgpu.controller.taint_rules import CLAIM_ANNOTATION, GROUP, PLURAL

TAINT_VERSION = "v1"  # the replay's control plane is 1.37


def allocations(api: Any, namespace: str) -> dict[str, list[str]]:
    """Claim name -> device names it was allocated (allocated claims only)."""
    resource: Any = client.ResourceV1Api(api)
    out: dict[str, list[str]] = {}
    for claim in resource.list_namespaced_resource_claim(namespace).items:
        allocation = claim.status.allocation if claim.status else None
        if allocation is not None and allocation.devices is not None:
            out[claim.metadata.name] = [r.device for r in allocation.devices.results or []]
    return out


def clearing_rules(api: Any) -> list[list[str]]:
    """[pool, tainted device, claim (namespace/name) it is cleared for] per clearing rule."""
    objects: Any = client.CustomObjectsApi(api)
    try:
        listed = objects.list_cluster_custom_object(GROUP, TAINT_VERSION, PLURAL)
    except client.ApiException:
        return []
    out: list[list[str]] = []
    for item in listed.get("items", []):
        notes = (item.get("metadata") or {}).get("annotations") or {}
        selector = (item.get("spec") or {}).get("deviceSelector") or {}
        if CLAIM_ANNOTATION in notes:
            out.append(
                [str(selector.get("pool")), str(selector.get("device")), notes[CLAIM_ANNOTATION]]
            )
    return sorted(out)


class Recorder:
    """Writes one line per step: the step, each publication's allocations, the clearings."""

    def __init__(self, path: Path | None) -> None:
        self._out: IO[str] | None = path.open("w") if path is not None else None

    def header(self, requests: Sequence[Any], steps: int) -> None:
        if self._out is None:
            return
        self._write(
            {
                "steps": steps,
                "requests": [[r.ident, r.kind, r.arrives, r.lifetime] for r in requests],
            }
        )

    def step(self, api: Any, step: int, namespaces: dict[str, str]) -> None:
        if self._out is None:
            return
        self._write(
            {
                "step": step,
                "allocations": {p: allocations(api, ns) for p, ns in namespaces.items()},
                "clearing": clearing_rules(api),
            }
        )

    def close(self) -> None:
        if self._out is not None:
            self._out.close()

    def _write(self, line: dict[str, Any]) -> None:
        assert self._out is not None
        self._out.write(json.dumps(line, sort_keys=True) + "\n")
        self._out.flush()
