"""Reading the cluster for ``flexgpu explain`` and ``flexgpu capacity``, with the rights the
user has.

Both read the cluster once into the same ``ClusterState`` the controller keeps and run the
same code on it, so what the CLI prints is what the controller's Events say. A namespace user
may not read everything: ResourceSlices and DeviceClasses need the read rights the chart
aggregates into ``view`` (``templates/rbac-aggregate.yaml``); claims of other namespaces and
nodes are read when allowed, and otherwise the answer says what it could not see
(``ClusterRead.notes``) instead of failing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kubernetes import client

from flexgpu.controller.cli_options import CliError, Connection, call
from flexgpu.controller.cluster_state import ClusterState, Snapshot
from flexgpu.driver.names import DRIVER_NAME

SLICE_RIGHTS = (
    "reading ResourceSlices and DeviceClasses needs the read rights the flexgpu chart "
    "aggregates into the view ClusterRole, granted cluster-wide (docs/cli.md, access)"
)


@dataclass
class ClusterRead:
    snapshot: Snapshot
    # What could not be read and what that means for the answer, one sentence each.
    notes: list[str] = field(default_factory=list)
    # False when nodes could not be read: node names come from the slices, without labels
    # or taints, so a pod's node selector and tolerations cannot be checked.
    nodes_known: bool = True
    # False when only the namespace's claims could be read.
    all_claims: bool = True


def _items(document: Any) -> list[dict[str, Any]]:
    return list(document.get("items") or [])


def _required(connection: Connection, what: str, function: Any, **kwargs: Any) -> Any:
    try:
        return call(connection, what, function, **kwargs)
    except CliError as err:
        if err.forbidden:
            raise CliError(f"{err.message}; {SLICE_RIGHTS}", status=err.status) from None
        raise


def list_slices(connection: Connection) -> list[dict[str, Any]]:
    """This driver's ResourceSlices, as the API returns them."""
    resource = client.ResourceV1Api(connection.api)
    return _items(
        _required(
            connection,
            "list ResourceSlices",
            resource.list_resource_slice,
            field_selector=f"spec.driver={DRIVER_NAME}",
        )
    )


def read_cluster(
    connection: Connection, *, namespace: str | None, pods: bool = False
) -> ClusterRead:
    """Slices, classes, claims and nodes; with ``pods``, the pods of ``namespace`` too.

    ``namespace=None`` means every namespace. Claims are read in every namespace when the user
    may (what other namespaces hold decides what is free); otherwise only ``namespace``'s.
    """
    api = connection.api
    resource, core = client.ResourceV1Api(api), client.CoreV1Api(api)
    state = ClusterState()
    notes: list[str] = []
    slices = _required(
        connection,
        "list ResourceSlices",
        resource.list_resource_slice,
        field_selector=f"spec.driver={DRIVER_NAME}",
    )
    state.replace("slices", _items(slices))
    state.replace(
        "classes", _items(_required(connection, "list DeviceClasses", resource.list_device_class))
    )

    all_claims = True
    try:
        claims = call(
            connection,
            "list ResourceClaims in all namespaces",
            resource.list_resource_claim_for_all_namespaces,
        )
    except CliError as err:
        if not err.forbidden or namespace is None:
            raise
        all_claims = False
        claims = call(
            connection,
            f"list ResourceClaims in namespace {namespace}",
            partial(resource.list_namespaced_resource_claim, namespace),
        )
        notes.append(
            "Claims of other namespaces are not visible to you: devices they hold count as "
            "free here."
        )
    state.replace("claims", _items(claims))

    nodes_known = True
    try:
        nodes = _items(call(connection, "list nodes", core.list_node))
    except CliError as err:
        if not err.forbidden:
            raise
        nodes_known = False
        # The slices name their nodes: enough to place devices, not to check node selectors.
        names = sorted({str(s["spec"].get("nodeName")) for s in _items(slices)} - {"None", ""})
        nodes = [{"metadata": {"name": n}} for n in names]
        notes.append(
            "Nodes are not visible to you: node selectors, affinity and taints were not checked."
        )
    state.replace("nodes", nodes)

    if pods and namespace is not None:
        listed = call(
            connection,
            f"list pods in namespace {namespace}",
            partial(core.list_namespaced_pod, namespace),
        )
        state.replace("pods", _items(listed))
    return ClusterRead(state.snapshot(), notes, nodes_known, all_claims)
