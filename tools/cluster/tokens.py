"""Credentials of a ServiceAccount, minted through the TokenRequest API, so local processes
act with exactly the RBAC a chart gives its pods. A token bound to a Node carries the node's
name, as a real pod's token does on that node."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes import client


def service_account_kubeconfig(
    api: Any,
    admin_kubeconfig: Path,
    namespace: str,
    service_account: str,
    out: Path,
    *,
    node: str | None = None,
    seconds: int = 3600,
) -> Path:
    core: Any = client.CoreV1Api(api)
    spec: dict[str, Any] = {"expirationSeconds": seconds}
    if node is not None:
        uid = core.read_node(node).metadata.uid
        spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
    issued = core.create_namespaced_service_account_token(
        service_account, namespace, {"spec": spec}
    )
    admin = yaml.safe_load(admin_kubeconfig.read_text())
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": admin["clusters"],
        "users": [{"name": service_account, "user": {"token": issued.status.token}}],
        "contexts": [
            {
                "name": "sa",
                "context": {"cluster": admin["clusters"][0]["name"], "user": service_account},
            }
        ],
        "current-context": "sa",
    }
    out.write_text(yaml.safe_dump(config))
    out.chmod(0o600)
    return out
