"""GPU clearing evicts only pods that can run elsewhere now (``driver.allocation.relocation``,
``controller.clearing_eviction``): every moving pod's claims, as fresh claims, must fit off
the GPU being cleared, off the other GPUs being cleared and off steered nodes, one pod after
another; otherwise nobody on that GPU is evicted and the waiting claim is told which claim has
nowhere to go. An Eviction API answer other than 429/404/409 refuses that pod only."""

from __future__ import annotations

import json
from typing import Any

from controller_builders import NOW, load, node, snapshot
from kubernetes import client
from test_controller_clearing import held, slices
from test_controller_clearing_consent import Told
from test_controller_clearing_eviction import (
    AFTER_S,
    MIG,
    WAITS,
    budgets_of,
    counted,
    holder,
    objects,
    setup,
)

from flexgpu.controller.clearing_eviction import (
    BLOCKED_RETRY_S,
    EVICTED,
    REFUSED,
    ApiPods,
    Evictions,
)
from flexgpu.driver.allocation.relocation import MovingPod, stranded

A = "gpu-0-mig-1g10gb-0"
E = "gpu-0-mig-1g10gb-1"


def _whole(pair: tuple[dict[str, Any], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The holder's claim asks for a whole GPU (while holding a partition)."""
    pair[0]["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.flexgpu.dev"
    return pair


def _past_the_bound(
    world_: dict[str, Any], steered_nodes: tuple[str, ...] = (), **kwargs: Any
) -> tuple[list[str], Told]:
    told = Told()
    clearing, evictor, _, clock, state = setup(sink=told, **kwargs)
    clearing.run_pass(load(state, **world_), NOW, steered_nodes)
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW, steered_nodes)
    return evictor.calls, told


# --- the decision ----------------------------------------------------------------------------


def _moving(snap: Any, *names: str, usable: tuple[str, ...] | None = None) -> list[MovingPod]:
    return [MovingPod(f"ns/{n}-pod", (snap.claims[f"ns/{n}"].model,), usable) for n in names]


def _stranded(snap: Any, moving: list[MovingPod], held_off: list[str]) -> Any:
    return stranded(
        moving,
        slices=snap.slice_list,
        classes=snap.classes,
        claims=snap.claim_models,
        nodes=snap.node_models,
        held_off=[("gpu.flexgpu.dev", "n1", d) for d in held_off],
    )


def _devices(snap: Any) -> list[str]:
    return [d.name for s in snap.slice_list for d in s.devices]


def _gpu0(snap: Any) -> list[str]:
    return [d for d in _devices(snap) if d == "gpu-0" or d.startswith("gpu-0-")]


def test_a_claim_fits_elsewhere_only_off_the_devices_held_off() -> None:
    snap = snapshot(**objects(holder("a", A)))
    every, gpu0 = _devices(snap), _gpu0(snap)
    assert _stranded(snap, _moving(snap, "a"), gpu0) is None
    # GPU 1 held off as well (being cleared for another claim): nowhere left on n1.
    found = _stranded(snap, _moving(snap, "a"), every)
    assert found is not None and found.claim == "ns/a" and found.pod == "ns/a-pod"
    # The pod may use no node at all.
    assert _stranded(snap, _moving(snap, "a", usable=()), gpu0) is not None


def test_pods_are_placed_one_after_another_so_two_do_not_count_on_the_same_room() -> None:
    # GPU 1 has four 1g partitions free (its memory slices 3-6) and a 3g one is four of them.
    big = [holder(n, d) for n, d in (("a", A), ("e", E))]
    for pair in big:
        pair[0]["spec"]["devices"]["requests"][0]["exactly"] = {
            "deviceClassName": MIG,
            "count": 1,
            "selectors": [
                {"cel": {"expression": 'device.attributes["gpu.flexgpu.dev"].profile == "3g.40gb"'}}
            ],
        }
    snap = snapshot(**objects(*big))
    gpu0 = _gpu0(snap)
    assert _stranded(snap, _moving(snap, "a"), gpu0) is None
    assert _stranded(snap, _moving(snap, "e"), gpu0) is None
    found = _stranded(snap, _moving(snap, "a", "e"), gpu0)
    assert found is not None and found.claim == "ns/e"


# --- the leader's passes ---------------------------------------------------------------------


def test_a_holder_with_nowhere_to_go_keeps_every_holder_and_the_claim_is_told_which() -> None:
    # Both GPUs of n1 have holders: a whole GPU fits nowhere but on the one being cleared.
    calls, told = _past_the_bound(objects(holder("e", E), _whole(holder("a", A))))
    assert calls == []
    waits = [m for r, m in told.messages if r == WAITS]
    assert len(waits) == 1
    assert "pod ns/a-pod would have nowhere to go now" in waits[0]
    assert "claim ns/a fits on no device outside the GPUs flexgpu keeps new claims off" in waits[0]


def test_room_on_another_node_lets_the_pod_move_unless_that_node_is_steered() -> None:
    # n1's GPU 1 is full of 1g partitions, so the holder's partition fits only on n2, whose
    # GPUs each hold one partition (so the waiting whole-GPU claim fits nowhere).
    full = [held(f"f{i}", "n1", f"gpu-1-mig-1g10gb-{i}") for i in range(3, 7)]
    world_ = objects(holder("a", A))
    world_["claims"] += [
        *full,
        held("x", "n2", "gpu-0-mig-1g10gb-0"),
        held("y", "n2", "gpu-1-mig-1g10gb-0"),
    ]
    world_["slices"] += slices("n2")
    world_["nodes"].append(node("n2"))
    calls, _ = _past_the_bound(world_)
    assert calls == ["ns/a-pod"]
    calls, told = _past_the_bound(world_, steered_nodes=("n2",))
    assert calls == []
    assert any("ns/a-pod would have nowhere to go" in m for r, m in told.messages if r == WAITS)


class _Core:
    """The Eviction API as the server answers: ``refuse`` maps a pod to (status, body)."""

    def __init__(self, refuse: dict[str, tuple[int, str]]) -> None:
        self.refuse = refuse
        self.calls: list[str] = []

    def create_namespaced_pod_eviction(
        self, name: str, namespace: str, body: Any, **_: Any
    ) -> None:
        self.calls.append(f"{namespace}/{name}")
        if name in self.refuse:
            status, message = self.refuse[name]
            err = client.ApiException(status=status, reason="Internal Server Error")
            err.body = json.dumps({"kind": "Status", "message": message})
            raise err


TWO_BUDGETS = (
    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not "
    "support."
)


def test_an_unexpected_status_is_the_pods_refusal_and_not_the_end_of_the_pass() -> None:
    pods = ApiPods(client.ApiClient())
    core = _Core({"a-pod": (500, TWO_BUDGETS), "f-pod": (403, "forbidden")})
    pods._core = core  # type: ignore[assignment]
    assert pods.evict("ns", "a-pod", "u") == ("refused", f"HTTP 500: {TWO_BUDGETS}")
    assert pods.evict("ns", "f-pod", "u") == ("refused", "HTTP 403: forbidden")
    assert pods.evict("ns", "e-pod", "u") == ("evicted", "")

    told = Told()
    clearing, _, _, clock, state = setup(max_in_flight=2, sink=told)
    evictions = Evictions(
        state, pods, told, budgets_of(), after_s=AFTER_S, max_in_flight=2, clock=clock
    )
    clearing._evictions = evictions
    core.calls.clear()
    world_ = objects(holder("a", A), holder("e", E))
    clearing.run_pass(load(state, **world_), NOW)
    before = counted("refused")
    clock.now += AFTER_S + 1
    clearing.run_pass(load(state, **world_), NOW)  # does not raise
    assert core.calls == ["ns/a-pod", "ns/e-pod"]  # the refusal did not stop the pass
    assert counted("refused") == before + 1
    refused = [(k, n) for k, n, r, _ in told.events if r == REFUSED]
    assert refused == [("Pod", "a-pod"), ("ResourceClaim", "big")]
    assert all(f"HTTP 500: {TWO_BUDGETS}" in m for r, m in told.messages if r == REFUSED)
    assert [n for k, n, r, _ in told.events if r == EVICTED and k == "Pod"] == ["e-pod"]
    # Asked again after the retry interval, not every pass.
    clock.now += 15
    clearing.run_pass(load(state, **world_), NOW)
    assert core.calls == ["ns/a-pod", "ns/e-pod"]
    clock.now += BLOCKED_RETRY_S
    clearing.run_pass(load(state, **world_), NOW)
    assert core.calls[2:] == ["ns/a-pod"]
