"""The combination matrix's taint dimension: the GPU node tainted as GPU pools are, and each
pod admitted as the controller's pod toleration webhook admits it (its own answer to the
review, over the row's template and classes as the API server has them; no controller runs
in the matrix)."""

from __future__ import annotations

import base64
import json
from typing import Any, Final

from kubernetes import client

from flexgpu.controller.gpu_tolerations import DEFAULT_GPU_TOLERATIONS, answer_toleration_review
from flexgpu.controller.pod_claim_lookup import ApiClaimLookup
from tools.cluster.nodes import mark_node_ready

GPU_TAINT: Final = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def taint_node(api: Any, node: str, tainted: bool) -> None:
    """``node`` with the GPU pool taint, or without it (another row's taint removed)."""
    if tainted:
        mark_node_ready(api, node, taints=[GPU_TAINT])
        return
    core = client.CoreV1Api(api)
    taints = core.read_node(node).spec.taints or []
    kept = [
        {"key": t.key, "value": t.value, "effect": t.effect}
        for t in taints
        if t.key != GPU_TAINT["key"]
    ]
    if len(kept) != len(taints):
        core.patch_node(node, {"spec": {"taints": kept or None}})


def admitted(api: Any, namespace: str, pod: dict[str, Any], tainted: bool) -> dict[str, Any]:
    """The pod as the webhook admits it where the node is tainted; as written elsewhere."""
    if not tainted:
        return pod
    review = {
        "request": {
            "uid": "matrix",
            "operation": "CREATE",
            "namespace": namespace,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": pod,
        }
    }
    answer = answer_toleration_review(list(DEFAULT_GPU_TOLERATIONS), ApiClaimLookup(api), review)
    assert answer is not None and "patch" in answer["response"], (pod["metadata"], answer)
    (op,) = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert op["path"] == "/spec/tolerations", op
    return {**pod, "spec": {**pod["spec"], "tolerations": op["value"]}}
