"""flexgpu.controller.admission: the pure checks, the review rules and the AdmissionReview
answer."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from flexgpu.controller.admission import (
    ADMISSION_TARGETS,
    MAX_LISTED_PROBLEMS,
    REJECTION_CODE,
    answer_admission_review,
    rejection_message,
    request_device_types,
    validate_device_class,
    validate_node_policy,
    validate_resource_claim,
    validate_resource_claim_template,
)

GPU = {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "GpuConfig"}
MIG = {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "MigConfig"}
PARAMS = "spec.devices.config[0].opaque.parameters"
QUANTITY = 'a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"'


def mps(**limits: Any) -> dict[str, Any]:
    return {**GPU, "sharing": {"strategy": "MPS", "mpsConfig": limits}}


def claim(
    parameters: Any,
    device_class: str = "gpu.flexgpu.dev",
    requests: list[str] | None = None,
    driver: str = "gpu.flexgpu.dev",
) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}],
                "config": [entry],
            }
        },
    }


BAD_CLAIMS: list[tuple[str, dict[str, Any], str]] = [
    (
        "GpuConfig for a MIG request",
        claim(GPU, "mig.flexgpu.dev", ["gpu"]),
        'spec.devices.config[0]: request "gpu": GpuConfig cannot configure a MIG device; '
        "use MigConfig",
    ),
    (
        "MigConfig for a shared GPU request",
        claim(MIG, "shared-gpu.flexgpu.dev", ["gpu"]),
        'spec.devices.config[0]: request "gpu": MigConfig cannot configure a shared GPU; '
        "use GpuConfig",
    ),
    (
        "unknown field",
        claim(mps(defaultActiveThreadPercentag=50)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentag: unknown field; allowed: "
        "defaultActiveThreadPercentage, defaultPinnedDeviceMemoryLimit, "
        "defaultPerDevicePinnedMemoryLimit, multiUser",
    ),
    (
        "percentage 0",
        claim(mps(defaultActiveThreadPercentage=0)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentage: 0 is not allowed; "
        "allowed: an integer from 1 to 100",
    ),
    (
        "percentage 101",
        claim(mps(defaultActiveThreadPercentage=101)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentage: 101 is not allowed; "
        "allowed: an integer from 1 to 100",
    ),
    (
        "negative quantity",
        claim(mps(defaultPinnedDeviceMemoryLimit="-1Gi")),
        f'{PARAMS}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "-1Gi" is not allowed; '
        f"allowed: {QUANTITY}",
    ),
    (
        "malformed quantity",
        claim(mps(defaultPinnedDeviceMemoryLimit="10GB")),
        f'{PARAMS}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10GB" is not allowed '
        f'(unknown suffix "GB"); allowed: {QUANTITY}',
    ),
    (
        "both sharing blocks",
        claim(
            {
                **GPU,
                "sharing": {
                    "strategy": "TimeSlicing",
                    "timeSlicingConfig": {"interval": "Short"},
                    "mpsConfig": {},
                },
            }
        ),
        f"{PARAMS}.sharing: timeSlicingConfig and mpsConfig together are not allowed; allowed: "
        "timeSlicingConfig with strategy TimeSlicing, or mpsConfig with strategy MPS",
    ),
    (
        # Prepare would refuse it: a share's limits are MPS limits.
        "time-slicing a shared GPU",
        claim({**GPU, "sharing": {"strategy": "TimeSlicing"}}, "shared-gpu.flexgpu.dev"),
        f'{PARAMS}.sharing.strategy: "TimeSlicing" is not supported on a shared GPU (request '
        '"gpu"; a share is enforced with MPS); allowed: Exclusive, MPS',
    ),
    (
        "multi-user MPS",
        claim(
            {**MIG, "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}},
            "mig.flexgpu.dev",
            ["gpu"],
        ),
        f"{PARAMS}.sharing.mpsConfig.multiUser: true is not supported: NVIDIA's DRA driver has "
        "no such setting, and the MPS control daemon flexgpu starts (MPS protocol 2) has no "
        "multi-user mode: it runs one MPS server per Linux user at a time, and clients of "
        "another user wait until that server exits (only the opt-in MPS v3 interface has a "
        "--multiuser flag, which flexgpu does not run); allowed: false, or leave it out and run "
        "the claim's containers as one user",
    ),
    (
        "wrong apiVersion",
        claim({**GPU, "apiVersion": "resource.nvidia.com/v1beta1"}),
        f'{PARAMS}.apiVersion: "resource.nvidia.com/v1beta1" is not allowed; allowed: '
        "gpu.flexgpu.dev/v1alpha1",
    ),
]


@pytest.mark.parametrize(("what", "obj", "expected"), BAD_CLAIMS, ids=[c[0] for c in BAD_CLAIMS])
def test_bad_claims_are_rejected_with_the_exact_text(
    what: str, obj: dict[str, Any], expected: str
) -> None:
    assert validate_resource_claim(obj) == [expected]


@pytest.mark.parametrize(
    "obj",
    [
        claim(GPU),
        claim(mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")),
        claim(MIG, "mig.flexgpu.dev", ["gpu"]),
        # MPS on a MIG device: its own daemon, as NVIDIA's driver starts it.
        claim(
            {
                **MIG,
                "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}},
            },
            "mig.flexgpu.dev",
            ["gpu"],
        ),
        claim({**GPU, "sharing": {"strategy": "MPS"}}, "shared-gpu.flexgpu.dev", ["gpu"]),
        # A blanket config of the other kind applies to no device here: skipped, as in prepare.
        claim(MIG, "gpu.flexgpu.dev"),
        # Another driver's config is not ours to judge, whatever it holds.
        claim({"anything": True}, driver="other.example.com"),
        claim({"anything": True}, "gpu.nvidia.com", driver="gpu.nvidia.com"),
        # A class we do not know: no kind check.
        claim(GPU, "example.com-gpu", ["gpu"]),
        {"spec": {"devices": {"requests": [{"name": "x"}]}}},
        {"spec": {}},
        {},
    ],
)
def test_good_claims_pass(obj: dict[str, Any]) -> None:
    assert validate_resource_claim(obj) == []


def test_every_problem_of_every_entry_is_listed() -> None:
    obj = claim({**GPU, "sharing": {"strategy": "Shared", "foo": 1}})
    obj["spec"]["devices"]["config"].append(
        {"opaque": {"driver": "gpu.flexgpu.dev", "parameters": {"kind": "GpuConfig"}}}
    )
    assert validate_resource_claim(obj) == [
        f'{PARAMS}.sharing.strategy: "Shared" is not allowed; allowed: Exclusive, TimeSlicing, MPS',
        f"{PARAMS}.sharing.foo: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig",
        "spec.devices.config[1].opaque.parameters.apiVersion: missing; allowed: "
        "gpu.flexgpu.dev/v1alpha1",
    ]


def test_templates_name_the_path_under_spec_spec() -> None:
    template = {"spec": {"spec": claim(mps(defaultActiveThreadPercentage=0))["spec"]}}
    assert validate_resource_claim_template(template) == [
        "spec.spec.devices.config[0].opaque.parameters.sharing.mpsConfig."
        "defaultActiveThreadPercentage: 0 is not allowed; allowed: an integer from 1 to 100"
    ]
    assert validate_resource_claim_template({"spec": {}}) == []


def test_first_available_subrequests_get_the_kind_of_their_class() -> None:
    requests = [
        {
            "name": "main",
            "firstAvailable": [
                {"name": "whole", "deviceClassName": "gpu.flexgpu.dev"},
                {"name": "slice", "deviceClassName": "mig.flexgpu.dev"},
                {"name": "other", "deviceClassName": "other.example.com"},
            ],
        },
        {"name": "plain", "exactly": {"deviceClassName": "shared-gpu.flexgpu.dev"}},
        {"exactly": {"deviceClassName": "gpu.flexgpu.dev"}},  # no name: skipped
        "junk",
    ]
    assert request_device_types(requests) == {
        "main/whole": "gpu",
        "main/slice": "mig",
        "plain": "shared",
    }
    obj = claim(MIG, requests=["main/slice"])
    obj["spec"]["devices"]["requests"] = requests
    assert validate_resource_claim(obj) == []
    obj["spec"]["devices"]["config"][0]["requests"] = ["main"]
    assert validate_resource_claim(obj) == [
        'spec.devices.config[0]: request "main/whole": MigConfig cannot configure a whole GPU; '
        "use GpuConfig"
    ]


def test_device_classes() -> None:
    def device_class(parameters: Any, driver: str = "gpu.flexgpu.dev") -> dict[str, Any]:
        return {"spec": {"config": [{"opaque": {"driver": driver, "parameters": parameters}}]}}

    assert validate_device_class(device_class(GPU)) == []
    assert validate_device_class(device_class(MIG)) == []
    assert validate_device_class(device_class({"x": 1}, driver="other.example.com")) == []
    assert validate_device_class({"spec": {"selectors": []}}) == []
    assert validate_device_class(device_class({**GPU, "sharing": {"strategy": "Shared"}})) == [
        'spec.config[0].opaque.parameters.sharing.strategy: "Shared" is not allowed; allowed: '
        "Exclusive, TimeSlicing, MPS"
    ]


def policy(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "p", "resourceVersion": "5", "managedFields": []},
        "spec": spec,
    }


def test_node_policies() -> None:
    assert validate_node_policy(policy(gpus=[{"selector": {"all": True}, "mode": "Whole"}])) == []
    assert validate_node_policy(
        policy(gpus=[{"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g10gb": 7}}])
    ) == [
        'spec.gpus[0].migLayout: key "1g10gb" is not allowed; allowed: a MIG profile name such '
        'as "1g.10gb", "1g.10gb+me" or "3g.40gb"'
    ]


def test_rejection_message_lists_every_problem() -> None:
    assert rejection_message(["a: b"]) == "a: b"
    assert rejection_message(["a: b", "c: d"]) == "2 problems:\n- a: b\n- c: d"
    many = [f"p{i}: x" for i in range(MAX_LISTED_PROBLEMS + 3)]
    text = rejection_message(many)
    assert text.startswith(f"{len(many)} problems:\n- p0: x\n")
    assert text.endswith(f"- p{MAX_LISTED_PROBLEMS - 1}: x\n- ... and 3 more problems")


def _review(operation: str, obj: Any, old: Any = None, plural: str = "resourceclaims") -> Any:
    group, version = (
        ("flexgpu.dev", "v1alpha1") if plural == "gpunodepolicies" else ("resource.k8s.io", "v1")
    )
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "resource": {"group": group, "version": version, "resource": plural},
            "operation": operation,
            "object": obj,
            "oldObject": old,
        },
    }


BAD = claim(mps(defaultActiveThreadPercentage=0))


def test_answer_admission_review() -> None:
    denied = answer_admission_review(_review("CREATE", BAD))
    assert denied == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": "u-1",
            "allowed": False,
            "status": {"message": validate_resource_claim(BAD)[0], "code": REJECTION_CODE},
        },
    }
    allowed = answer_admission_review(_review("CREATE", claim(GPU)))
    assert allowed is not None and allowed["response"] == {"uid": "u-1", "allowed": True}
    assert answer_admission_review(_review("CREATE", BAD, plural="pods")) is None
    bad_policy = policy(priority="high")
    answer = answer_admission_review(_review("CREATE", bad_policy, plural="gpunodepolicies"))
    assert answer is not None and answer["response"]["allowed"] is False


def test_updates_are_checked_only_when_the_checked_part_changed() -> None:
    relabelled = {**BAD, "metadata": {**BAD["metadata"], "labels": {"a": "b"}}}
    deleting = {**BAD, "metadata": {**BAD["metadata"], "deletionTimestamp": "2025-01-01T00:00Z"}}

    def allowed(review: Any) -> bool:
        answer = answer_admission_review(review)
        assert answer is not None
        return bool(answer["response"]["allowed"])

    assert allowed(_review("UPDATE", relabelled, old=BAD))
    assert allowed(_review("UPDATE", deleting, old=claim(GPU)))
    assert allowed(_review("DELETE", None, old=BAD))
    assert not allowed(_review("UPDATE", BAD, old=claim(GPU)))
    # A policy's spec edit is checked; a metadata-only edit of a now-invalid one is not.
    bad_policy = policy(priority="high")
    relabelled_policy = {**bad_policy, "metadata": {"name": "p", "labels": {"x": "y"}}}
    good_policy = policy(priority=1)
    review = _review("UPDATE", relabelled_policy, old=bad_policy, plural="gpunodepolicies")
    assert allowed(review)
    review = _review("UPDATE", bad_policy, old=good_policy, plural="gpunodepolicies")
    assert not allowed(review)


def test_every_resource_is_answered_and_others_are_not_ours() -> None:
    """One answer per checked resource (the webhook's paths), counted per kind; a review of
    anything else, or of a subresource, is not ours to answer."""
    for handler_id, group, version, plural, _, _ in ADMISSION_TARGETS:
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": handler_id,
                "operation": "DELETE",
                "resource": {"group": group, "version": version, "resource": plural},
            },
        }
        labels = {"kind": plural, "allowed": "true"}
        before = REGISTRY.get_sample_value("flexgpu_webhook_decisions_total", labels) or 0
        answer = answer_admission_review(body)
        assert answer is not None and answer["response"] == {"uid": handler_id, "allowed": True}
        assert REGISTRY.get_sample_value("flexgpu_webhook_decisions_total", labels) == before + 1
        status = {**body, "request": {**body["request"], "subResource": "status"}}
        assert answer_admission_review(status) is None
    pods = {"request": {"resource": {"group": "", "version": "v1", "resource": "pods"}}}
    assert answer_admission_review(pods) is None


NVIDIA = "gpu.nvidia.com"


def test_nvidia_driver_config_on_flexgpu_requests_is_refused_with_the_fix() -> None:
    """A half-migrated claim (flexgpu's class, NVIDIA's driver name on its config) would run
    without its sharing: neither driver reads that config."""
    obj = claim(mps(), "shared-gpu.flexgpu.dev", driver=NVIDIA)
    (problem,) = validate_resource_claim(obj)
    assert problem.startswith(
        "spec.devices.config[0].opaque.driver: 'gpu.nvidia.com' is read by no driver here: "
        "request(s) gpu ask for shared-gpu.flexgpu.dev"
    )
    assert problem.endswith("set opaque.driver to 'gpu.flexgpu.dev'")
    template = {"spec": {"spec": claim(mps(), requests=["gpu"], driver=NVIDIA)["spec"]}}
    (problem,) = validate_resource_claim_template(template)
    assert problem.startswith("spec.spec.devices.config[0].opaque.driver:")


def test_nvidia_driver_config_that_nvidia_can_read_passes() -> None:
    """A request of NVIDIA's class (or a firstAvailable that may end on it) reads the config:
    none of flexgpu's business."""
    assert validate_resource_claim(claim(mps(), "gpu.nvidia.com", driver=NVIDIA)) == []
    obj = claim(mps(), driver=NVIDIA, requests=["main"])
    obj["spec"]["devices"]["requests"] = [
        {
            "name": "main",
            "firstAvailable": [
                {"name": "ours", "deviceClassName": "gpu.flexgpu.dev"},
                {"name": "theirs", "deviceClassName": "gpu.nvidia.com"},
            ],
        }
    ]
    assert validate_resource_claim(obj) == []
    obj["spec"]["devices"]["config"][0]["requests"] = ["main/ours"]
    (problem,) = validate_resource_claim(obj)
    assert "request(s) main/ours ask for gpu.flexgpu.dev" in problem
