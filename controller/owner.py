"""The owner of what the controller creates at run time in its namespace (its leader Lease and
its webhook certificate Secret): the controller's Deployment, named by ``--owner-deployment``.
With it as their ownerReference, Kubernetes' garbage collector deletes them when the
Deployment goes, so ``helm uninstall`` leaves nothing of the controller behind."""

from __future__ import annotations

import logging
from typing import Any

from kubernetes import client

log = logging.getLogger(__name__)


def deployment_owner(api: client.ApiClient, namespace: str, name: str) -> dict[str, Any] | None:
    """The ownerReference for Deployment ``namespace/name``; None (and a warning: the objects
    are then left when it is deleted) when it cannot be read."""
    try:
        deployment: Any = client.AppsV1Api(api).read_namespaced_deployment(
            name, namespace, _request_timeout=10
        )
    except client.ApiException as error:
        log.warning(
            "cannot read Deployment %s/%s to own the Lease and webhook Secret (%s %s); they "
            "will stay when it is deleted",
            namespace,
            name,
            error.status,
            error.reason,
        )
        return None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": name,
        "uid": deployment.metadata.uid,
    }
