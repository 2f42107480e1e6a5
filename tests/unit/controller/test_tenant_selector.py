"""The tenant selector admission adds to shared-GPU requests: rendered for the request's
namespace (never the object's), on every shared-gpu request and firstAvailable subrequest
of claims and templates and on nothing else, ANDed after the user's own selectors so none
can widen it, once only (reinvocation and claims from mutated templates add nothing); its
CEL keeps a namespace off a GPU serving another and lets it on a free one or its own."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

import pytest

from flexgpu.controller.admission_review import parse_review
from flexgpu.controller.tenant_selector import (
    TENANT_CLAIMS_HANDLER,
    TENANT_TEMPLATES_HANDLER,
    answer_tenant_review,
    tenant_expression,
    tenant_patch,
)
from flexgpu.driver.allocation.cel import device_activation, evaluate
from flexgpu.driver.allocation.model import parse_device
from flexgpu.driver.names import DRIVER_NAME, SHARED_GPU_DEVICE_CLASS

SHARED = SHARED_GPU_DEVICE_CLASS


def _apply(doc: Any, ops: list[Any]) -> Any:
    """RFC 6902 ``add`` as the apiserver applies it (the only op the webhook emits)."""
    out = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] == "add"
        *parents, last = op["path"].strip("/").split("/")
        target = out
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if last == "-":
            target.append(op["value"])
        else:
            target[last] = op["value"]
    return out


def _selector(namespace: str) -> dict[str, Any]:
    return {"cel": {"expression": tenant_expression(namespace)}}


def _spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"requests": list(requests)}}


def _exactly(name: str, cls: str, *selectors: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": cls}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def _shared_gpu(tenant: str | None) -> Any:
    attributes: dict[str, Any] = {"type": {"string": "shared"}}
    if tenant is not None:
        attributes["tenant"] = {"string": tenant}
    return device_activation(DRIVER_NAME, parse_device({"name": "gpu-0", "attributes": attributes}))


@pytest.mark.parametrize(
    ("tenant", "matches"),
    [("", True), ("team-a", True), ("team-b", False), (None, True)],
)
def test_the_selector_lets_a_namespace_onto_free_or_own_gpus_only(
    tenant: str | None, matches: bool
) -> None:
    """A GPU without the attribute (older plugin, or namespaces allowed to share) matches:
    no CEL error aborts scheduling, and prepare's guard decides there."""
    assert evaluate(tenant_expression("team-a"), _shared_gpu(tenant)) is matches


def test_devices_of_another_driver_match_without_error() -> None:
    other = device_activation("other.example.org", parse_device({"name": "x", "attributes": {}}))
    assert evaluate(tenant_expression("team-a"), other)


def test_every_shared_request_and_subrequest_gets_it_after_the_users_own() -> None:
    spec = _spec(
        _exactly("plain", SHARED),
        _exactly("mine", SHARED, 'device.attributes["gpu.flexgpu.dev"].index == 0'),
        _exactly("whole", "gpu.flexgpu.dev"),
        {
            "name": "either",
            "firstAvailable": [
                {"name": "frac", "deviceClassName": SHARED},
                {"name": "mig", "deviceClassName": "mig.flexgpu.dev"},
            ],
        },
    )
    out = _apply({"spec": spec}, tenant_patch(spec, "team-a"))["spec"]["devices"]["requests"]
    ours = _selector("team-a")
    assert out[0]["exactly"]["selectors"] == [ours]
    assert out[1]["exactly"]["selectors"][0]["cel"]["expression"].endswith("index == 0")
    assert out[1]["exactly"]["selectors"][1] == ours, "ANDed after the user's selector"
    assert "selectors" not in out[2]["exactly"]
    assert out[3]["firstAvailable"][0]["selectors"] == [ours]
    assert "selectors" not in out[3]["firstAvailable"][1]


def test_a_claim_naming_another_tenant_still_gets_its_own_namespaces_selector() -> None:
    """A user's selector asking for team-b's GPU is ANDed with team-a's: no GPU of team-b
    can satisfy both, so the claim cannot name another tenant or opt out."""
    sneaky = tenant_expression("team-b").split(" || ", 1)[1]
    spec = _spec(_exactly("gpu", SHARED, sneaky))
    out = _apply({"spec": spec}, tenant_patch(spec, "team-a"))["spec"]
    selectors = out["devices"]["requests"][0]["exactly"]["selectors"]
    on_b = _shared_gpu("team-b")
    assert not all(evaluate(s["cel"]["expression"], on_b) for s in selectors)


def test_adding_it_twice_adds_nothing() -> None:
    spec = _spec(_exactly("gpu", SHARED))
    once = _apply({"spec": spec}, tenant_patch(spec, "team-a"))["spec"]
    assert tenant_patch(once, "team-a") == []


def test_claims_without_a_shared_request_are_left_alone() -> None:
    assert tenant_patch(_spec(_exactly("gpu", "gpu.flexgpu.dev")), "team-a") == []
    assert tenant_patch({}, "team-a") == []
    assert tenant_patch({"devices": {"requests": "nonsense"}}, "team-a") == []


def _review(
    handler: str, obj: dict[str, Any], namespace: str = "team-a", operation: str = "CREATE"
) -> dict[str, Any]:
    plural = "resourceclaims" if handler == TENANT_CLAIMS_HANDLER else "resourceclaimtemplates"
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u1",
            "operation": operation,
            "namespace": namespace,
            "userInfo": {"username": "alice"},
            "resource": {"group": "resource.k8s.io", "version": "v1", "resource": plural},
            "object": obj,
        },
    }


def _patched(answer: dict[str, Any] | None, obj: dict[str, Any]) -> dict[str, Any]:
    assert answer is not None and answer["response"]["allowed"] is True
    assert answer["response"]["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(answer["response"]["patch"]))
    return dict(_apply(obj, ops))


def test_the_namespace_is_the_requests_not_one_the_object_claims() -> None:
    claim = {"metadata": {"namespace": "team-b"}, "spec": _spec(_exactly("gpu", SHARED))}
    review = _review(TENANT_CLAIMS_HANDLER, claim, namespace="team-a")
    body, refusal = parse_review(json.dumps(review).encode(), TENANT_CLAIMS_HANDLER)
    assert refusal is None and body is not None
    out = _patched(answer_tenant_review(TENANT_CLAIMS_HANDLER, body), claim)
    assert out["spec"]["devices"]["requests"][0]["exactly"]["selectors"] == [_selector("team-a")]


def test_templates_get_it_in_the_claim_spec_they_stamp_out() -> None:
    template = {"spec": {"spec": _spec(_exactly("gpu", SHARED))}}
    answer = answer_tenant_review(
        TENANT_TEMPLATES_HANDLER, _review(TENANT_TEMPLATES_HANDLER, template)
    )
    out = _patched(answer, template)
    requests = out["spec"]["spec"]["devices"]["requests"]
    assert requests[0]["exactly"]["selectors"] == [_selector("team-a")]


def test_only_creates_of_the_handlers_resource_are_mutated() -> None:
    claim = {"spec": _spec(_exactly("gpu", SHARED))}
    update = answer_tenant_review(
        TENANT_CLAIMS_HANDLER, _review(TENANT_CLAIMS_HANDLER, claim, operation="UPDATE")
    )
    assert update is not None and "patch" not in update["response"]
    wrong = _review(TENANT_TEMPLATES_HANDLER, claim)
    assert answer_tenant_review(TENANT_CLAIMS_HANDLER, wrong) is None
    _, refusal = parse_review(json.dumps(wrong).encode(), TENANT_CLAIMS_HANDLER)
    assert refusal is not None and refusal.status == 400
