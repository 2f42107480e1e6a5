"""Connecting to the API server, for the controller and the ``flexgpu`` CLI.

Objects are read as the server's raw JSON rather than the client's models: the generated models
lag the API (they drop fields such as ``consumedCapacity`` or ``allowMultipleAllocations``
that allocation depends on), and the allocation parsers take JSON anyway.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubernetes import client, config

DEFAULT_KUBECONFIG = "~/.kube/config"


class KubeConfigError(RuntimeError):
    """No usable credentials: not in a cluster and no kubeconfig."""


def _configuration(kubeconfig: str | None, *, in_cluster_first: bool) -> client.Configuration:
    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        return configuration
    if in_cluster_first:
        try:
            config.load_incluster_config(client_configuration=configuration)
            return configuration
        except config.ConfigException:
            pass
    path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or DEFAULT_KUBECONFIG
    if not Path(path).expanduser().exists():
        raise KubeConfigError(
            f"no kubeconfig at {path} and not running in a cluster; pass --kubeconfig"
        )
    config.load_kube_config(
        config_file=str(Path(path).expanduser()), client_configuration=configuration
    )
    return configuration


def api_client(kubeconfig: str | None = None, *, in_cluster_first: bool = True) -> client.ApiClient:
    """A client from ``kubeconfig``; without one, the pod's service account (when
    ``in_cluster_first``) and then ``$KUBECONFIG`` / ``~/.kube/config``."""
    try:
        return client.ApiClient(_configuration(kubeconfig, in_cluster_first=in_cluster_first))
    except config.ConfigException as err:
        raise KubeConfigError(str(err)) from None


def clone(api: client.ApiClient) -> client.ApiClient:
    """A second client with the same credentials: each long watch holds a connection, so
    every thread gets its own pool instead of starving the others."""
    return client.ApiClient(api.configuration)


def raw(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The server's JSON for a generated-client call."""
    response = call(*args, _preload_content=False, **kwargs)
    return json.loads(response.data)
