"""Pending-claim selection: the grace period, our classes, unallocated claims, pods without a
node, claims made from templates."""

from __future__ import annotations

from controller_builders import NOW, A, claim, holding, pod, request, snapshot

from flexgpu.controller.pending import our_classes, pending_claims
from flexgpu.driver.allocation import parse_device_class


def _pending(**objects: list) -> list[tuple[str, str]]:
    snap = snapshot(**objects)
    return [(p.pod.name, p.claim.model.name) for p in pending_claims(snap, NOW, 30)]


def test_only_pods_past_the_delay_without_a_node() -> None:
    claims = [claim("c1", request()), claim("c2", request()), claim("c3", request())]
    pods = [
        pod("old", "c1", age_s=60),
        pod("new", "c2", age_s=5),
        pod("bound", "c3", age_s=60, node_name="n1"),
    ]
    assert _pending(claims=claims, pods=pods) == [("old", "c1")]


def test_allocated_claims_and_other_classes_are_left_out() -> None:
    claims = [
        holding("done", "n1", "gpu-0"),
        claim("nic", request("nic.example.com")),
        claim("mig", request("mig.flexgpu.dev")),
    ]
    pods = [pod("p", "done", "nic", "mig")]
    assert _pending(claims=claims, pods=pods) == [("p", "mig")]


def test_admin_class_naming_our_driver_counts() -> None:
    custom = {
        "metadata": {"name": "big-gpus"},
        "spec": {"selectors": [{"cel": {"expression": f"{A}.index < 4"}}]},
    }
    foreign = {
        "metadata": {"name": "not-ours"},
        "spec": {"selectors": [{"cel": {"expression": 'device.driver == "x.gpu.flexgpu.dev"'}}]},
    }
    classes = {c["metadata"]["name"]: parse_device_class(c) for c in (custom, foreign)}
    assert "big-gpus" in our_classes(classes) and "not-ours" not in our_classes(classes)


def test_template_claims_are_found_by_their_generated_name_once_made() -> None:
    claims = [claim("p-gpu-x7", request())]
    pods = [pod("p", templates={"gpu": "p-gpu-x7"}), pod("q", templates={"gpu": None})]
    assert _pending(claims=claims, pods=pods) == [("p", "p-gpu-x7")]


def test_oldest_pod_first_and_deleting_pods_skipped() -> None:
    claims = [claim("a", request()), claim("b", request()), claim("c", request())]
    going = pod("going", "c", age_s=500)
    going["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"
    pods = [pod("young", "a", age_s=40), pod("elder", "b", age_s=400), going]
    assert _pending(claims=claims, pods=pods) == [("elder", "b"), ("young", "a")]
