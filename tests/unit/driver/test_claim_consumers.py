"""status.reservedFor read once: pods by name, a gang's PodGroup as podgroups.scheduling.k8s.io
(never taken for a pod of the same name), malformed entries skipped; the plugin's usage label
and the controller's explain record show the same."""

from __future__ import annotations

from flexgpu.controller.records import claim_record
from flexgpu.driver.claim_consumers import Consumer, consumers
from flexgpu.kubelet_plugin.observe.usage_model import claim_info

POD = {"resource": "pods", "name": "worker-0", "uid": "u1"}
GROUP = {"apiGroup": "scheduling.k8s.io", "resource": "podgroups", "name": "worker-0", "uid": "u2"}


def test_pods_and_podgroups_are_told_apart() -> None:
    pod, group = consumers({"reservedFor": [POD, GROUP, "junk"]})
    assert pod == Consumer("", "pods", "worker-0", "u1")
    assert (pod.is_pod, pod.is_pod_group, pod.label) == (True, False, "worker-0")
    assert (group.is_pod, group.is_pod_group) == (False, True)
    assert group.label == "podgroups.scheduling.k8s.io/worker-0"
    other = Consumer("", "things", "t", "u")
    assert (other.is_pod, other.is_pod_group, other.label) == (False, False, "things/t")
    assert consumers(None) == () == consumers({"reservedFor": None})


def test_usage_counts_only_pods_for_process_attribution_but_names_the_group() -> None:
    info = claim_info({"status": {"reservedFor": [GROUP, POD]}})
    assert [p.uid for p in info.pods] == ["u1"]  # a group's uid is no pod's uid
    assert info.users == ("worker-0", "podgroups.scheduling.k8s.io/worker-0")


def test_explain_record_names_the_podgroup() -> None:
    claim = {
        "metadata": {"name": "c", "namespace": "ml", "uid": "x"},
        "spec": {"devices": {"requests": []}},
        "status": {"reservedFor": [GROUP]},
    }
    assert claim_record(claim).reserved_for == ("podgroups.scheduling.k8s.io/worker-0",)
