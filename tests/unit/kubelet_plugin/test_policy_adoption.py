"""MIG devices another tool made (nvidia-mig-parted, the GPU operator, by hand) are adopted:
published as they are with no policy, kept when a policy asks for the same layout, never
destroyed for another layout unless the policy says ``existingMigDevices: Replace``, and
flexgpu's own layout is still flexgpu's after a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.names import CRD_GROUP
from flexgpu.driver.node_policy import NodePolicyError, parse_node_policy
from flexgpu.kubelet_plugin.agents.mig_ownership import MigOwnership
from flexgpu.kubelet_plugin.agents.policy_agent import PLURAL, VERSION, PolicyAgent
from tests.conftest import wait_for
from tests.unit.kubelet_plugin.fake_kube_api import FakeKubeApi
from tests.unit.kubelet_plugin.prepare_support import NODE, ClaimTable, Node

POLICIES = f"/apis/{CRD_GROUP}/{VERSION}/{PLURAL}"
NODES = "/api/v1/nodes"
GPU = 0  # a whole GPU on the prepare_support node (an H100)
MADE_BEFORE = {"3g.40gb": 1, "2g.20gb": 1, "1g.10gb": 1}


def _policy(layout: dict[str, int] | None, existing: str | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"selector": {"indices": [GPU]}, "mode": "MIG", "migLayout": layout}
    if existing is not None:
        entry["existingMigDevices"] = existing
    return {
        "apiVersion": f"{CRD_GROUP}/{VERSION}",
        "kind": "GpuNodePolicy",
        "metadata": {"name": "split", "generation": 1, "resourceVersion": "10"},
        "spec": {"nodeSelector": {"matchLabels": {"pool": "p"}}, "gpus": [entry]},
    }


def _lay_out(node: Node, layout: dict[str, int]) -> set[str]:
    """Makes the layout through the backend, as another tool would, before the plugin runs."""
    backend = node.backend
    backend.set_mig_mode(GPU, True)
    profiles = {p.name: p for p in backend.mig_profiles(GPU)}
    for name, count in sorted(layout.items(), key=lambda kv: -profiles[kv[0]].memory_slices):
        for _ in range(count):
            for placement in backend.possible_placements(GPU, profiles[name].profile_id):
                try:
                    backend.create_mig_device(GPU, profiles[name].profile_id, placement)
                    break
                except Exception:  # taken: the next placement
                    continue
    assert len(node.backend.list_mig_devices(GPU)) == sum(layout.values())
    node.restart()
    return _uuids(node)


def _uuids(node: Node) -> set[str]:
    return {str(d.uuid) for d in node.backend.list_mig_devices(GPU)}


def _published(node: Node) -> dict[str, dict[str, Any]]:
    return {
        d["name"]: d for d in node.devices.slice_devices() if d["name"].startswith(f"gpu-{GPU}")
    }


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path, ClaimTable())


def _run_agent(node: Node, policies: list[dict[str, Any]]) -> tuple[FakeKubeApi, PolicyAgent]:
    api = FakeKubeApi()
    api.lists[POLICIES] = policies
    api.lists[NODES] = [
        {"metadata": {"name": NODE, "resourceVersion": "20", "labels": {"pool": "p"}}}
    ]
    for policy in policies:
        api.put_object(f"{POLICIES}/{policy['metadata']['name']}", policy)
    agent = PolicyAgent(
        api,  # type: ignore[arg-type]
        NODE,
        devices=node.devices,
        preparer=node.preparer,
        lock=node.lock,
        republish=lambda: None,
        ownership=MigOwnership(node.data_dir / "mig-owned.json"),
    )
    agent.start()
    wait_for(lambda: agent.passes >= 1, what="the agent's first pass")
    return api, agent


@pytest.fixture
def agents() -> Iterator[list[PolicyAgent]]:
    started: list[PolicyAgent] = []
    yield started
    for agent in started:
        agent.stop()


def _gpu_status(api: FakeKubeApi) -> dict[str, Any]:
    status: dict[str, Any] = api.objects[f"{POLICIES}/split"]["status"]
    return dict(status["nodes"][NODE]["gpus"][str(GPU)])


def test_without_a_policy_the_layout_is_published_and_left_alone(
    node: Node, agents: list[PolicyAgent]
) -> None:
    made = _lay_out(node, MADE_BEFORE)
    _, agent = _run_agent(node, [])
    agents.append(agent)
    published = _published(node)
    assert f"gpu-{GPU}" not in published
    assert {d["attributes"]["uuid"]["string"] for d in published.values()} == made
    assert _uuids(node) == made


def test_a_policy_asking_for_the_same_layout_keeps_the_devices(
    node: Node, agents: list[PolicyAgent]
) -> None:
    made = _lay_out(node, MADE_BEFORE)
    api, agent = _run_agent(node, [_policy(MADE_BEFORE)])
    agents.append(agent)
    assert _gpu_status(api)["reason"] == "Applied"
    assert _uuids(node) == made
    assert node.devices.mode(GPU) == "MIG"


def test_another_layout_waits_for_the_admin_and_keeps_serving(
    node: Node, agents: list[PolicyAgent]
) -> None:
    made = _lay_out(node, MADE_BEFORE)
    api, agent = _run_agent(node, [_policy({"1g.10gb": 7})])
    agents.append(agent)
    status = _gpu_status(api)
    assert status["reason"] == "Pending"
    assert "did not create (3g.40gb@" in status["message"]
    assert "spec.gpus[0].existingMigDevices: Replace" in status["message"]
    assert _uuids(node) == made
    # Still served, and not kept off new claims: nothing is going to change by itself.
    assert all("taints" not in d for d in _published(node).values())
    assert len(_published(node)) == 3


def test_replace_lets_the_policy_destroy_them_and_records_its_own(
    node: Node, agents: list[PolicyAgent]
) -> None:
    made = _lay_out(node, MADE_BEFORE)
    api, agent = _run_agent(node, [_policy({"1g.10gb": 7}, "Replace")])
    agents.append(agent)
    assert _gpu_status(api)["reason"] == "Applied"
    ours = _uuids(node)
    assert len(ours) == 7 and not ours & made
    assert MigOwnership(node.data_dir / "mig-owned.json").owned() == ours


def test_flexgpus_own_layout_is_changed_after_a_restart_without_replace(
    node: Node, agents: list[PolicyAgent]
) -> None:
    node.backend.set_mig_mode(GPU, True)
    node.restart()
    _, first = _run_agent(node, [_policy({"1g.10gb": 7})])
    first.stop()
    assert len(_uuids(node)) == 7
    node.restart()  # a new plugin process: modes start from the flags again
    api, second = _run_agent(node, [_policy({"3g.40gb": 2})])
    agents.append(second)
    assert _gpu_status(api)["reason"] == "Applied"
    assert len(_uuids(node)) == 2


def test_an_unreadable_record_makes_every_device_foreign(tmp_path: Path) -> None:
    path = tmp_path / "mig-owned.json"
    path.write_text("[1, 2")
    assert MigOwnership(path).owned() == frozenset()
    path.write_text('{"version": 9, "migDevices": ["MIG-x"]}')
    assert MigOwnership(path).owned() == frozenset()
    record = MigOwnership(path)
    record.update(added=["MIG-a", "MIG-b"])
    record.update(removed=["MIG-a"])
    assert MigOwnership(path).owned() == {"MIG-b"}


def test_a_bad_choice_is_refused_naming_the_field_and_the_choices() -> None:
    with pytest.raises(NodePolicyError) as err:
        parse_node_policy(_policy({"1g.10gb": 7}, "Delete"))
    assert "spec.gpus[0].existingMigDevices" in str(err.value)
    assert "Keep, Replace" in str(err.value)
