"""flexgpu explain on a gang member (spec.schedulingGroup): when its claim could be allocated
alone, the pod waits for its PodGroup, and explain says so instead of leaving the reader with
"not its GPUs"; a pod outside a gang gets no such note."""

from __future__ import annotations

import pytest
from controller_builders import claim, node, node_slices, pod, request, snapshot

from flexgpu.controller import cli_explain
from flexgpu.controller.cli_cluster import ClusterRead
from flexgpu.controller.records import pod_record


def _member(name: str, group: str | None) -> dict[str, object]:
    raw = pod(name, "c")
    if group is not None:
        raw["spec"]["schedulingGroup"] = {"podGroupName": group}
    return raw


@pytest.mark.parametrize("group", ["train", None])
def test_allocatable_claim_of_a_gang_member_names_its_podgroup(
    monkeypatch: pytest.MonkeyPatch, group: str | None
) -> None:
    monkeypatch.setattr(cli_explain, "_events", lambda *_: [])
    raw = _member("w0", group)
    read = ClusterRead(
        snapshot(
            slices=node_slices("n1", "hgx-h100-8"),
            nodes=[node("n1")],
            claims=[claim("c", request(count=4))],
            pods=[raw],
        )
    )
    [finding] = cli_explain.explain_pod(None, read, raw)  # type: ignore[arg-type]
    assert finding.state == "Allocatable" and not finding.blocked
    note = "is a member of PodGroup train"
    assert (note in finding.message) == (group is not None), finding.message
    assert pod_record(raw).pod_group == (group or "")  # type: ignore[union-attr]
