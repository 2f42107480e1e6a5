"""Every admission decision is counted, so a dashboard shows rejections and their kind."""

from __future__ import annotations

from typing import Any

from flexgpu.controller import admission
from flexgpu.controller.metrics import WEBHOOK_DECISIONS

BAD = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "metadata": {"name": "c"},
    "spec": {
        "devices": {
            "requests": [],
            "config": [
                {
                    "opaque": {
                        "driver": "gpu.flexgpu.dev",
                        "parameters": {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "Nope"},
                    }
                }
            ],
        }
    },
}


def _count(allowed: str) -> float:
    return WEBHOOK_DECISIONS.labels(kind="resourceclaims", allowed=allowed)._value.get()


def _review(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "operation": "CREATE",
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": "resourceclaims"},
            "object": obj,
        },
    }


def test_decisions_are_counted_by_kind_and_outcome() -> None:
    before_no, before_yes = _count("false"), _count("true")
    refused = admission.answer_admission_review(_review(BAD))
    assert refused is not None and refused["response"]["allowed"] is False
    good = {**BAD, "spec": {"devices": {"requests": []}}}
    allowed = admission.answer_admission_review(_review(good))
    assert allowed is not None and allowed["response"]["allowed"] is True
    assert (_count("false"), _count("true")) == (before_no + 1, before_yes + 1)
