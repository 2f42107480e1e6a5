"""The chart's pod toleration webhook: rendered as the controller builds it, with the
failurePolicy and tolerations of the values, the rights it needs (and none without it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.unit.test_chart import find, helm, render

__all__ = ["helm"]  # the fixture, shared with test_chart.py

NAME = "t-flexgpu-gpu-tolerations"


def _args(docs: list[dict[str, object]]) -> list[str]:
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    return list(spec["containers"][0]["args"])


def test_the_toleration_webhook_is_the_controllers_own(helm: Path) -> None:
    from flexgpu.controller.toleration_webhook_config import (
        build_toleration_webhook_configuration,
    )
    from flexgpu.controller.webhook_config import ServiceRef

    docs = render(helm, "webhook.failurePolicy.tolerations=Fail")
    rendered = find(docs, "MutatingWebhookConfiguration", "gpu-tolerations")
    assert rendered["metadata"]["name"] == NAME
    built = build_toleration_webhook_configuration(
        ServiceRef("flexgpu-system", "t-flexgpu-controller", 443),
        None,
        name="unused",
        failure_policy="Fail",
    )
    assert rendered["webhooks"] == built["webhooks"]
    args = _args(docs)
    assert f"--toleration-webhook-configuration-name={NAME}" in args
    tolerations = next(a for a in args if a.startswith("--gpu-tolerations="))
    assert json.loads(tolerations.split("=", 1)[1]) == [
        {"effect": "NoSchedule", "key": "nvidia.com/gpu", "operator": "Exists"}
    ]
    role = find(docs, "ClusterRole", "controller")
    assert {
        "apiGroups": ["resource.k8s.io"],
        "resources": ["resourceclaimtemplates"],
        "verbs": ["get"],
    } in role["rules"]
    own = [r for r in role["rules"] if NAME in r.get("resourceNames", [])]
    assert [set(r["verbs"]) for r in own] == [{"get", "update", "patch"}]
    policy = find(docs, "ValidatingAdmissionPolicy", "controller-own-webhook-configuration")
    expressions = " ".join(v["expression"] for v in policy["spec"]["validations"])
    assert NAME in expressions and '["pods"]' in expressions


def test_the_admins_tolerations_reach_the_controller(helm: Path) -> None:
    docs = render(
        helm,
        "webhook.gpuTolerations[0].key=gpu",
        "webhook.gpuTolerations[0].operator=Equal",
        "webhook.gpuTolerations[0].value=a100",
        "webhook.gpuTolerations[0].effect=NoExecute",
    )
    from flexgpu.controller.admission_server import build_parser

    args = build_parser().parse_args(
        [a for a in _args(docs) if a.startswith(("--gpu-tolerations", "--toleration"))]
    )
    assert args.gpu_tolerations == [
        {"key": "gpu", "operator": "Equal", "value": "a100", "effect": "NoExecute"}
    ]


@pytest.mark.parametrize("values", ["webhook.gpuTolerations=null", "webhook.enabled=false"])
def test_without_tolerations_there_is_no_pod_webhook_and_no_right_for_it(
    helm: Path, values: str
) -> None:
    docs = render(helm, values)
    assert not [d for d in docs if d["metadata"]["name"] == NAME]
    role = find(docs, "ClusterRole", "controller")
    assert not any("resourceclaimtemplates" in r["resources"] for r in role["rules"])
    assert not any(NAME in r.get("resourceNames", []) for r in role["rules"])
    assert not any(a.startswith("--gpu-tolerations") for a in _args(docs))


def test_a_bad_toleration_is_refused_by_the_schema(helm: Path) -> None:
    with pytest.raises(subprocess.CalledProcessError) as err:
        render(helm, "webhook.gpuTolerations[0].key=gpu", "webhook.gpuTolerations[0].operator=In")
    assert "gpuTolerations" in err.value.stderr
