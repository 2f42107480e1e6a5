"""Every admission decision is counted, so a dashboard shows rejections and their kind."""

from __future__ import annotations

import kopf
import pytest

from controller import admission
from controller.metrics import WEBHOOK_DECISIONS

BAD = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "c"},
    "spec": {"devices": {"requests": [], "config": [{"opaque": {
        "driver": "gpu.flexgpu.dev",
        "parameters": {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "Nope"}}}]}},
}


def _count(allowed: str) -> float:
    return WEBHOOK_DECISIONS.labels(kind="resourceclaims", allowed=allowed)._value.get()


def test_decisions_are_counted_by_kind_and_outcome() -> None:
    target = next(t for t in admission.ADMISSION_TARGETS if t[3] == "resourceclaims")
    handle = admission._handler(target[4], target[5], "resourceclaims")
    before_no, before_yes = _count("false"), _count("true")
    with pytest.raises(kopf.AdmissionError):
        handle(operation="CREATE", new=BAD, old=None)
    good = {**BAD, "spec": {"devices": {"requests": []}}}
    handle(operation="CREATE", new=good, old=None)
    assert (_count("false"), _count("true")) == (before_no + 1, before_yes + 1)
