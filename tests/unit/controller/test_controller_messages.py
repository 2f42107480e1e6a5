"""The words of a diagnosis, one reason at a time, plus the fingerprint and the length cap."""

from __future__ import annotations

from typing import Any

from controller_builders import CAP, A, claim, holding, node, node_slices, pod, request, snapshot

from flexgpu.controller.evaluation import evaluate
from flexgpu.controller.messages import (
    MAX_MESSAGE,
    Lookup,
    claim_message,
    clip,
    fingerprint,
    pod_message,
)
from flexgpu.controller.records import PodRecord
from flexgpu.driver.names import DRIVER_NAME

L4 = f'{A}.productName == "NVIDIA L4"'
H100 = f'{A}.productName.startsWith("NVIDIA H100")'
TAINT = {"key": "flexgpu.dev/maintenance", "value": "true", "effect": "NoSchedule"}


def _world(**extra: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    slices = node_slices("l4", "l4-2-pcie") + node_slices("h100", "hgx-h100-8")
    nodes = [node("l4", {"zone": "a"}), node("h100", {"zone": "b"})]
    return {"slices": slices + extra.pop("slices", []), "nodes": nodes + extra.pop("nodes", [])}


def _explain(target: dict[str, Any], pod_body: dict[str, Any], **objects: Any) -> tuple[str, str]:
    others = objects.pop("claims", [])
    snap = snapshot(claims=[target, *others], pods=[pod_body], **objects)
    record = snap.claims[f"ns/{target['metadata']['name']}"]
    waiting: PodRecord = snap.pods[f"ns/{pod_body['metadata']['name']}"]
    ev = evaluate(snap, record, waiting)
    assert not ev.satisfiable, ev.explanation.message
    lookup = Lookup(snap)
    return pod_message(ev, lookup), claim_message(ev, lookup)


def test_all_matching_devices_taken_names_the_holders() -> None:
    target = claim("want", request("gpu.flexgpu.dev", 1, L4))
    hog = holding("hog", "l4", "gpu-0", "gpu-1")
    text, claim_text = _explain(target, pod("p", "want"), claims=[hog], **_world())
    assert text.startswith("Claim want cannot be allocated on any node this pod may use.")
    assert 'Request "gpu" wants 1 device of class gpu.flexgpu.dev where' in text
    assert (
        "2 of the 10 devices in the class match: 2 allocated to other claims (ns/hog); 0 free."
        in text
    )
    assert claim_text.startswith("Pod p waits for this claim;")


def test_near_miss_lists_the_largest_devices_first() -> None:
    target = claim(
        "big", request("gpu.flexgpu.dev", 1, f'{CAP}.memory.compareTo(quantity("100Gi")) >= 0')
    )
    text, _ = _explain(target, pod("p", "big"), **_world())
    assert (
        "None of the 10 devices in the class matches; the largest are 8 NVIDIA H100 80GB HBM3"
        in text
    )
    assert text.index("H100") < text.index("NVIDIA L4 with 22.5Gi")


def test_devices_on_excluded_nodes_say_which_node_and_why() -> None:
    target = claim("h", request("gpu.flexgpu.dev", 2, H100))
    text, _ = _explain(target, pod("p", "h", node_selector={"zone": "a"}), **_world())
    assert "The pod may use 1 of 2 nodes." in text
    assert (
        "8 on nodes this pod cannot use (h100: nodeSelector zone=a does not match); 0 free." in text
    )


def test_tainted_devices_name_the_taint() -> None:
    world = _world(slices=node_slices("a100", "dgx-a100-8", taint=TAINT), nodes=[node("a100")])
    target = claim("t", request("gpu.flexgpu.dev", 1, f'{A}.productName.startsWith("NVIDIA A100")'))
    text, _ = _explain(target, pod("p", "t"), **world)
    assert "8 tainted flexgpu.dev/maintenance=true:NoSchedule, not tolerated by the request" in text


def test_constraint_counts_the_largest_group() -> None:
    slices = node_slices("h100", "hgx-h100-8")
    for s in slices:
        for i, d in enumerate(s["spec"].get("devices", [])):
            d["attributes"] = {**d["attributes"], "nvlinkDomain": {"string": f"pair-{i // 2}"}}
    target = claim(
        "nv",
        request("gpu.flexgpu.dev", 3, H100),
        constraints=[{"matchAttribute": f"{DRIVER_NAME}/nvlinkDomain"}],
    )
    text, _ = _explain(target, pod("p", "nv"), slices=slices, nodes=[node("h100")])
    assert "8 matching devices free." in text
    assert (
        "Constraint matchAttribute gpu.flexgpu.dev/nvlinkDomain needs 3 devices with the same "
        "nvlinkDomain on one node, but at most 2 free matching devices share one, and no more "
        "than 2 do even with nothing else allocated: the claim cannot fit as written." in text
    )


def test_more_gpus_than_any_node_has_says_it_can_never_fit() -> None:
    """Nine GPUs on 8-GPU nodes: the count of free GPUs alone (12 here, over two nodes)
    would suggest waiting; the message says no node can ever give nine."""
    slices = node_slices("h1", "hgx-h100-8") + node_slices("h2", "hgx-h100-8")
    hog = holding("hog", "h1", "gpu-0", "gpu-1", "gpu-2", "gpu-3")
    target = claim("nine", request("gpu.flexgpu.dev", 9, H100))
    text, _ = _explain(
        target, pod("p", "nine"), slices=slices, nodes=[node("h1"), node("h2")], claims=[hog]
    )
    assert "12 free; no node the pod may use has more than 8 of them even with nothing" in text
    assert "ask for at most 8 per pod" in text


def test_nine_fitting_in_free_count_is_not_called_impossible_when_a_node_has_room() -> None:
    """Four GPUs wanted, four held on one node: the other node has eight, nothing is said
    about a ceiling (the claim is simply allocatable there)."""
    slices = node_slices("h1", "hgx-h100-8")
    hog = holding("hog", "h1", "gpu-0", "gpu-1", "gpu-2", "gpu-3", "gpu-4")
    target = claim("four", request("gpu.flexgpu.dev", 4, H100))
    text, _ = _explain(target, pod("p", "four"), slices=slices, nodes=[node("h1")], claims=[hog])
    assert "3 free" in text and "never" not in text and "at most 8 per pod" not in text


def test_shared_gpu_without_enough_left_names_what_is_left_and_who_shares() -> None:
    slices = node_slices("s", "l4-2-pcie", shared=(0,))
    share = holding("share-hog", "s", "gpu-0", memory="16Gi", compute="50")
    target = claim(
        "want", request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "12Gi"}})
    )
    text, _ = _explain(target, pod("p", "want"), slices=slices, nodes=[node("s")], claims=[share])
    assert (
        "The one device in the class matches: 1 without enough capacity left beside other" in text
    )
    assert "(the most left on one: memory 6.5Gi), shared by ns/share-hog; 0 free." in text


def test_shared_gpu_too_small_in_total() -> None:
    slices = node_slices("s", "l4-2-pcie", shared=(0,))
    target = claim(
        "huge", request("shared-gpu.flexgpu.dev", capacity={"requests": {"memory": "40Gi"}})
    )
    text, _ = _explain(target, pod("p", "huge"), slices=slices, nodes=[node("s")])
    assert "1 smaller than requested (the most on one: memory 22.5Gi)" in text


def test_no_node_open_to_the_pod() -> None:
    target = claim("c", request())
    text, _ = _explain(target, pod("p", "c", node_selector={"zone": "z"}), **_world())
    assert "No node is open to the pod (h100: nodeSelector zone=z does not match, l4:" in text


def test_fingerprint_ignores_counts_but_not_reasons() -> None:
    world = _world()
    target = claim("want", request("gpu.flexgpu.dev", 1, L4))
    waiting = pod("p", "want")

    def print_of(*others: dict[str, Any]) -> tuple[object, ...]:
        snap = snapshot(claims=[target, *others], pods=[waiting], **world)
        return fingerprint(evaluate(snap, snap.claims["ns/want"], snap.pods["ns/p"]))

    both = print_of(holding("a", "l4", "gpu-0"), holding("b", "l4", "gpu-1"))
    renamed = print_of(holding("x", "l4", "gpu-0", "gpu-1"))
    assert both == renamed
    tainted_world = {**world, "slices": node_slices("l4", "l4-2-pcie", taint=TAINT)}
    snap = snapshot(claims=[target], pods=[waiting], **tainted_world)
    assert fingerprint(evaluate(snap, snap.claims["ns/want"], snap.pods["ns/p"])) != both


def test_messages_are_capped() -> None:
    assert len(clip("x" * 5000)) == MAX_MESSAGE and clip("short") == "short"
