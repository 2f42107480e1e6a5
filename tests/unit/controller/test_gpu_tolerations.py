"""The pod toleration webhook (controller/gpu_tolerations.py): which pods get the GPU-node
tolerations, that a toleration is never added twice, and that the admin's tolerations are
checked with errors naming the field."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import pytest

from flexgpu.controller.gpu_tolerations import (
    DEFAULT_GPU_TOLERATIONS,
    TolerationError,
    answer_toleration_review,
    parse_tolerations,
    pod_uses_flexgpu,
    toleration_patch,
)

GPU = {"selectors": [{"cel": {"expression": 'device.driver == "gpu.flexgpu.dev" && x'}}]}
OTHER = {"selectors": [{"cel": {"expression": "device.driver == 'gpu.nvidia.com'"}}]}
TOLERATIONS = list(DEFAULT_GPU_TOLERATIONS)


def _spec(cls: str, **extra: Any) -> dict[str, Any]:
    return {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": cls}}]}, **extra}


class Lookup:
    """The objects of one cluster, and which were read."""

    def __init__(self) -> None:
        self.claims: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.templates: dict[tuple[str, str], Mapping[str, Any]] = {}
        self.classes: dict[str, Mapping[str, Any]] = {
            "gpu.flexgpu.dev": GPU,
            "gpu.nvidia.com": OTHER,
        }
        self.reads: list[str] = []

    def claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.reads.append(f"claim {namespace}/{name}")
        return self.claims.get((namespace, name))

    def template_claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        self.reads.append(f"template {namespace}/{name}")
        return self.templates.get((namespace, name))

    def device_class_spec(self, name: str) -> Mapping[str, Any] | None:
        self.reads.append(f"class {name}")
        return self.classes.get(name)


def _pod(*claims: dict[str, str], tolerations: list[Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c"}],
        "resourceClaims": [{"name": f"c{i}", **c} for i, c in enumerate(claims)],
    }
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return {"metadata": {"name": "p"}, "spec": spec}


def _review(pod: dict[str, Any], operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "operation": operation,
            "namespace": "team",
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": pod,
            "userInfo": {},
        },
    }


def _patch(answer: dict[str, Any] | None) -> list[Any]:
    assert answer is not None and answer["response"]["allowed"] is True
    if "patch" not in answer["response"]:
        return []
    assert answer["response"]["patchType"] == "JSONPatch"
    ops: list[Any] = json.loads(base64.b64decode(answer["response"]["patch"]))
    return ops


def test_a_pod_with_a_template_of_a_flexgpu_class_gets_the_toleration() -> None:
    lookup = Lookup()
    lookup.templates[("team", "one-gpu")] = _spec("gpu.flexgpu.dev")
    pod = _pod({"resourceClaimTemplateName": "one-gpu"})
    assert _patch(answer_toleration_review(TOLERATIONS, lookup, _review(pod))) == [
        {"op": "add", "path": "/spec/tolerations", "value": TOLERATIONS}
    ]
    assert lookup.reads == ["template team/one-gpu", "class gpu.flexgpu.dev"]


@pytest.mark.parametrize(
    ("claim", "served"),
    [
        (_spec("gpu.flexgpu.dev"), True),
        (_spec("gpu.nvidia.com"), False),
        (_spec("not-there"), False),
        # A class of the admin's own that selects flexgpu's devices (single quotes).
        (_spec("mine"), True),
        # Another driver's class, but flexgpu's opaque config: the claim is flexgpu's.
        (
            _spec(
                "gpu.nvidia.com",
            )
            | {
                "devices": {
                    **_spec("gpu.nvidia.com")["devices"],
                    "config": [{"opaque": {"driver": "gpu.flexgpu.dev", "parameters": {}}}],
                }
            },
            True,
        ),
        # firstAvailable: the second alternative is flexgpu's.
        (
            {
                "devices": {
                    "requests": [
                        {
                            "name": "r",
                            "firstAvailable": [
                                {"name": "a", "deviceClassName": "gpu.nvidia.com"},
                                {"name": "b", "deviceClassName": "gpu.flexgpu.dev"},
                            ],
                        }
                    ]
                }
            },
            True,
        ),
        ({}, False),
    ],
)
def test_which_claims_are_flexgpus(claim: dict[str, Any], served: bool) -> None:
    lookup = Lookup()
    lookup.classes["mine"] = {
        "selectors": [{"cel": {"expression": "'gpu.flexgpu.dev' == device.driver"}}]
    }
    lookup.claims[("team", "c")] = claim
    assert pod_uses_flexgpu(_pod({"resourceClaimName": "c"}), "team", lookup) is served


def test_pods_of_other_drivers_and_missing_claims_are_left_alone() -> None:
    lookup = Lookup()
    lookup.claims[("team", "nv")] = _spec("gpu.nvidia.com")
    # A claim in another namespace of the same name is not the pod's.
    lookup.claims[("elsewhere", "gone")] = _spec("gpu.flexgpu.dev")
    pod = _pod({"resourceClaimName": "nv"}, {"resourceClaimName": "gone"})
    assert _patch(answer_toleration_review(TOLERATIONS, lookup, _review(pod))) == []


def test_a_toleration_already_there_is_not_added_again() -> None:
    present = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    other = {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}
    pod = _pod(tolerations=[dict(present)])
    assert toleration_patch(pod, TOLERATIONS) == []
    # Another toleration beside it: only the missing one is appended.
    pod = _pod(tolerations=[other])
    assert toleration_patch(pod, [*TOLERATIONS, *TOLERATIONS]) == [
        {"op": "add", "path": "/spec/tolerations/-", "value": present}
    ]
    # Applying the patch and asking again changes nothing (reinvocation).
    pod["spec"]["tolerations"].append(present)
    assert toleration_patch(pod, TOLERATIONS) == []
    # Same key but another effect is a different toleration.
    pod = _pod(tolerations=[{**present, "effect": "NoExecute"}])
    assert len(toleration_patch(pod, TOLERATIONS)) == 1


def test_only_pod_creations_are_mutated() -> None:
    lookup = Lookup()
    lookup.claims[("team", "c")] = _spec("gpu.flexgpu.dev")
    pod = _pod({"resourceClaimName": "c"})
    assert _patch(answer_toleration_review(TOLERATIONS, lookup, _review(pod, "UPDATE"))) == []
    claims_review = _review(pod)
    claims_review["request"]["resource"] = {
        "group": "resource.k8s.io",
        "version": "v1",
        "resource": "resourceclaims",
    }
    assert answer_toleration_review(TOLERATIONS, lookup, claims_review) is None


def test_a_failed_read_is_not_taken_for_a_missing_claim() -> None:
    """An API error must reach the API server (which applies the failurePolicy), not pass
    the pod unchanged as though the claim were not flexgpu's."""

    class Broken(Lookup):
        def claim_spec(self, namespace: str, name: str) -> Mapping[str, Any] | None:
            raise RuntimeError("apiserver unavailable")

    with pytest.raises(RuntimeError):
        answer_toleration_review(TOLERATIONS, Broken(), _review(_pod({"resourceClaimName": "c"})))


def test_the_admins_tolerations_are_normalised() -> None:
    assert parse_tolerations(
        [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
            {"key": "gpu", "value": "true"},
            {"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
        ]
    ) == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "gpu", "operator": "Equal", "value": "true"},
        {"key": "gpu", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60},
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"key": "a"}, "tolerations: {'key': 'a'} is not allowed; allowed: a list"),
        ([{"operator": "Exists"}], "tolerations[0].key: '' is not allowed"),
        (
            [{"key": "a", "operator": "In"}],
            "tolerations[0].operator: 'In' is not allowed; allowed: Exists, Equal",
        ),
        ([{"key": "a", "operator": "Exists", "value": "x"}], "tolerations[0].value: 'x'"),
        ([{"key": "a", "effect": "NoRun"}], "tolerations[0].effect: 'NoRun' is not allowed"),
        ([{"key": "a", "tolerationSeconds": 5}], "tolerations[0].tolerationSeconds: 5"),
        ([{"key": "a", "colour": "x"}], "tolerations[0].colour: unknown field"),
        (["a"], "tolerations[0]: 'a' is not allowed; allowed: an object"),
    ],
)
def test_bad_tolerations_are_refused_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(TolerationError) as error:
        parse_tolerations(value)
    assert message in str(error.value)
