"""The chart's rights tried as an attacker would, with the chart's own ServiceAccount tokens
(the plugin's bound to a node, as a pod's is) against the real control plane, the chart
installed with helm at its defaults: every row of each table is a write a stolen token might
try, and each must be refused. The allowed side (what the plugin and the controller need)
is checked beside each table and by test_chart_install.py, which runs both daemons with
these tokens. docs/security.md names each row."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client, config

from tests.conftest import target_minor
from tests.integration.test_chart_install import (
    CONTROLLER_SA,
    NODE_A,
    NODE_B,
    NS,
    PLUGIN_SA,
    RELEASE,
    WEBHOOK_CONFIGURATION,
    _denial,
    _policies_loaded,
    installed,
    run,
)
from tools.cluster import ControlPlane, create_simulated_node
from tools.cluster.binaries import REPO_ROOT
from tools.cluster.tokens import service_account_kubeconfig

pytestmark = pytest.mark.integration

__all__ = ["installed"]  # the release these tests attack (a module fixture of its own here)

DRIVER = "gpu.flexgpu.dev"
OTHER_DRIVER = "gpu.nvidia.com"
CLAIM_STATUS_POLICY = f"{RELEASE}-kubelet-plugin-own-node-claim-status"
# Kubernetes 1.36+ checks status.devices writes itself (resourceclaims/driver).
GRANULAR = 36


def _as(kubeconfig: Path) -> Any:
    return config.new_client_from_config(config_file=str(kubeconfig))


def _plugin_of(cluster: ControlPlane, api: Any, node: str) -> Any:
    path = cluster.workdir / f"attack-plugin-{node}.kubeconfig"
    return _as(service_account_kubeconfig(api, cluster.kubeconfig, NS, PLUGIN_SA, path, node=node))


def _controller(cluster: ControlPlane, api: Any) -> Any:
    path = cluster.workdir / "attack-controller.kubeconfig"
    return _as(service_account_kubeconfig(api, cluster.kubeconfig, NS, CONTROLLER_SA, path))


# --------------------------------------------------------------------------- slices


def _slice(name: str, node: str, pool: str, devices: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": pool, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": d} for d in devices],
        },
    }


@pytest.mark.core
def test_plugin_cannot_shadow_another_nodes_pool(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """The issue's case: node A's plugin publishes node B's pool (B's device names) on A, so
    the scheduler would allocate (node-b, gpu-1) on A and count B's own slices as stale."""
    create_simulated_node(api, NODE_A)
    create_simulated_node(api, NODE_B)
    as_a: Any = client.ResourceV1Api(_plugin_of(cluster, api, NODE_A))
    as_b: Any = client.ResourceV1Api(_plugin_of(cluster, api, NODE_B))
    admin: Any = client.ResourceV1Api(api)
    theirs = _slice(f"{NODE_B}-attack-own", NODE_B, NODE_B, ["gpu-0", "gpu-1"])
    ours = _slice(f"{NODE_A}-attack-own", NODE_A, NODE_A, ["gpu-0"])
    shadow = _slice(f"{NODE_A}-attack-shadow", NODE_A, NODE_B, ["gpu-0", "gpu-1"])
    as_b.create_resource_slice(theirs)  # allowed: B's plugin, B's pool
    as_a.create_resource_slice(ours)  # allowed: A's plugin, A's pool
    try:
        _policies_loaded(as_a.create_resource_slice, shadow)
        rows = {
            "create a slice of pool node-b on node A": lambda: as_a.create_resource_slice(shadow),
            "create a slice of node B": lambda: as_a.create_resource_slice(
                _slice(f"{NODE_B}-attack-by-a", NODE_B, NODE_B, ["gpu-9"])
            ),
            "delete node B's slice": lambda: as_a.delete_resource_slice(theirs["metadata"]["name"]),
            "take over node B's slice": lambda: as_a.patch_resource_slice(
                theirs["metadata"]["name"], {"spec": {"devices": [{"name": "gpu-7"}]}}
            ),
        }
        refused = {what: _denial(call) for what, call in rows.items()}
        assert (
            f"may only write ResourceSlices of the pool named after that node, not of pool "
            f"'{NODE_B}'" in refused["create a slice of pool node-b on node A"]
        )
        # Pool node-b is still B's alone, as B published it.
        pool = [
            s
            for s in admin.list_resource_slice().items
            if s.spec.pool.name == NODE_B and s.spec.driver == DRIVER
        ]
        assert [(s.metadata.name, s.spec.node_name) for s in pool] == [
            (theirs["metadata"]["name"], NODE_B)
        ]
        assert [d.name for d in pool[0].spec.devices] == ["gpu-0", "gpu-1"]
    finally:
        for body in (theirs, ours, shadow):
            try:
                admin.delete_resource_slice(body["metadata"]["name"])
            except client.ApiException as error:
                assert error.status == 404


# --------------------------------------------------------------------------- claim status


def _allocated_claim(
    api: Any, namespace: str, name: str, node: str, results: list[tuple[str, str, str]]
) -> dict[str, Any]:
    """A claim the scheduler (here: the admin) allocated on ``node``: results of
    (driver, pool, device), each for request "gpu"."""
    resource: Any = client.ResourceV1Api(api)
    resource.create_namespaced_resource_claim(
        namespace,
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "allocationMode": "ExactCount",
                                "count": len(results),
                            },
                        }
                    ]
                }
            },
        },
    )
    claim = _claim(api, namespace, name)
    claim["status"] = {
        "allocation": {
            "devices": {
                "results": [
                    {"request": "gpu", "driver": d, "pool": p, "device": dev}
                    for d, p, dev in results
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        }
    }
    resource.replace_namespaced_resource_claim_status(name, namespace, claim)
    return _claim(api, namespace, name)


def _claim(api: Any, namespace: str, name: str) -> dict[str, Any]:
    read = client.ResourceV1Api(api).read_namespaced_resource_claim(name, namespace)
    body: dict[str, Any] = client.ApiClient().sanitize_for_serialization(read)
    return body


def _with_devices(claim: dict[str, Any], *entries: tuple[str, str, str]) -> dict[str, Any]:
    changed = copy.deepcopy(claim)
    changed["status"]["devices"] = [
        *changed["status"].get("devices", []),
        *({"driver": d, "pool": p, "device": dev} for d, p, dev in entries),
    ]
    return changed


def _status_attacks(
    cluster: ControlPlane, api: Any, namespace: str, policy_only: bool
) -> dict[str, str]:
    """Node A's plugin token tries each write of the table on claims allocated on node A and
    node B; returns each refusal. Then checks that nothing changed and that its own entry
    it may write. ``policy_only``: the admission policy is what must refuse (it waits for it)."""
    create_simulated_node(api, NODE_A)
    create_simulated_node(api, NODE_B)
    plugin: Any = client.ResourceV1Api(_plugin_of(cluster, api, NODE_A))
    theirs = _allocated_claim(api, namespace, "on-b", NODE_B, [(DRIVER, NODE_B, "gpu-0")])
    ours = _allocated_claim(
        api,
        namespace,
        "on-a",
        NODE_A,
        [(DRIVER, NODE_A, "gpu-0"), (OTHER_DRIVER, NODE_A, "x"), (OTHER_DRIVER, NODE_A, "y")],
    )
    # Another driver's entry, written by that driver (here: the admin), before the plugin's.
    client.ResourceV1Api(api).replace_namespaced_resource_claim_status(
        "on-a", namespace, _with_devices(ours, (OTHER_DRIVER, NODE_A, "x"))
    )
    ours = _claim(api, namespace, "on-a")

    def write(claim: dict[str, Any], **kwargs: Any) -> Any:
        # As the plugin writes first: a merge patch guarded by resourceVersion, here making
        # the three status fields exactly the row's (a field the row lacks is removed).
        status = claim.get("status") or {}
        fields = {key: status.get(key) for key in ("allocation", "reservedFor", "devices")}
        return plugin.patch_namespaced_resource_claim_status(
            claim["metadata"]["name"],
            namespace,
            {"metadata": claim["metadata"], "status": fields},
            _content_type="application/merge-patch+json",
            **kwargs,
        )

    def replace(claim: dict[str, Any], **kwargs: Any) -> Any:
        # Its second form (the claim as read, status.devices replaced): refused alike.
        return plugin.replace_namespaced_resource_claim_status(
            claim["metadata"]["name"], namespace, claim, **kwargs
        )

    foreign = _with_devices(theirs, (DRIVER, NODE_B, "gpu-0"))
    if policy_only:
        _policies_loaded(write, foreign)
    other_driver = copy.deepcopy(ours)
    other_driver["status"]["devices"][0]["conditions"] = [
        {
            "type": "Ready",
            "status": "False",
            "reason": "Attack",
            "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
        }
    ]
    removed = copy.deepcopy(ours)
    removed["status"]["devices"] = []
    deallocated = copy.deepcopy(ours)
    deallocated["status"] = {}
    reserved = copy.deepcopy(ours)
    reserved["status"]["reservedFor"] = [
        {"resource": "pods", "name": "someone-elses", "uid": "0d0d0d0d-0000-4000-8000-000000000000"}
    ]
    rows = {
        "a claim of node B: its device status": foreign,
        "its own claim: another driver's entry changed": other_driver,
        "its own claim: another driver's entry removed": removed,
        "its own claim: another driver's new entry": _with_devices(
            ours, (OTHER_DRIVER, NODE_A, "y")
        ),
        "its own claim: deallocated": deallocated,
        "its own claim: reserved for another pod": reserved,
    }
    refused = {what: _denial(write, body) for what, body in rows.items()}
    for body in rows.values():
        _denial(replace, body)
    # Nothing changed; and its own entry it may write.
    assert _claim(api, namespace, "on-b")["status"] == theirs["status"]
    assert _claim(api, namespace, "on-a")["status"] == ours["status"]
    written = write(_with_devices(ours, (DRIVER, NODE_A, "gpu-0")))
    assert {(d.driver, d.device) for d in written.status.devices} == {
        (OTHER_DRIVER, "x"),
        (DRIVER, "gpu-0"),
    }
    return refused


def _assert_refused_by_the_policy(refused: dict[str, str]) -> None:
    assert (
        f"may only write status.devices entries of its own pool, not of pool '{NODE_B}'"
        in refused["a claim of node B: its device status"]
    )
    for row in ("entry changed", "entry removed", "new entry"):
        message = refused[f"its own claim: another driver's {row}"]
        assert f"may only write status.devices entries of driver {DRIVER}" in message
        assert f"not of driver '{OTHER_DRIVER}'" in message
    for row in ("deallocated", "reserved for another pod"):
        assert "not status.allocation or status.reservedFor" in refused[f"its own claim: {row}"]


@pytest.mark.core
def test_plugin_writes_only_its_nodes_claim_status(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    """On every supported release: 1.36+ by the apiserver's resourceclaims/driver check (the
    chart grants only associated-node:patch for gpu.flexgpu.dev), 1.34/1.35 by the chart's
    admission policy, which helm renders for the server it installs to."""
    granular = target_minor() >= GRANULAR
    admission: Any = client.AdmissionregistrationV1Api(api)
    names = {p.metadata.name for p in admission.list_validating_admission_policy().items}
    assert (CLAIM_STATUS_POLICY in names) is not granular
    refused = _status_attacks(cluster, api, namespace, policy_only=not granular)
    if not granular:
        _assert_refused_by_the_policy(refused)
        return
    # Node B's claim: A's token would need arbitrary-node, which the chart never grants.
    message = refused["a claim of node B: its device status"]
    assert "resourceclaims/driver" in message and "cannot arbitrary-node:patch" in message
    assert (
        "cannot associated-node:patch" in refused["its own claim: another driver's entry removed"]
    )
    assert "resourceclaims/binding" in refused["its own claim: deallocated"]
    assert "resourceclaims/binding" in refused["its own claim: reserved for another pod"]


def test_plugin_reads_claims_for_binding_conditions_and_writes_none(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    """Binding conditions (1.36+) let the plugin list and watch ResourceClaims, since no
    field selector reaches a claim's allocation; before 1.36 the chart grants no such read.
    Either way the token writes no claim: not a spec, not a deletion, not a new claim."""
    create_simulated_node(api, NODE_A)
    plugin: Any = client.ResourceV1Api(_plugin_of(cluster, api, NODE_A))
    _allocated_claim(api, namespace, "read-me", NODE_B, [(DRIVER, NODE_B, "gpu-0")])
    if target_minor() >= GRANULAR:
        names = [c.metadata.name for c in plugin.list_resource_claim_for_all_namespaces().items]
        assert "read-me" in names
    else:
        assert "resourceclaims" in _denial(plugin.list_resource_claim_for_all_namespaces)
    claim = _claim(api, namespace, "read-me")
    claim["metadata"]["labels"] = {"rewritten": "yes"}
    refused = {
        "replace a claim": _denial(
            plugin.replace_namespaced_resource_claim, "read-me", namespace, claim
        ),
        "delete a claim": _denial(plugin.delete_namespaced_resource_claim, "read-me", namespace),
        "create a claim": _denial(
            plugin.create_namespaced_resource_claim,
            namespace,
            {"metadata": {"name": "planted"}, "spec": {"devices": {"requests": []}}},
        ),
    }
    for what, message in refused.items():
        assert "forbidden" in message.lower(), what


@pytest.mark.core
def test_claim_status_policy_alone_refuses_the_same_writes(
    cluster: ControlPlane, api: Any, namespace: str, installed: Path
) -> None:
    """The admission policy that guards 1.34/1.35 (and 1.36+ with the granular check turned
    off: claimStatusAdmissionPolicy=always), tried on this release with the apiserver's own
    check out of the way: the plugin's ServiceAccount is given arbitrary-node and binding
    rights for the test, so only the policy stands between its token and each write."""
    granular = target_minor() >= GRANULAR
    rbac: Any = client.RbacAuthorizationV1Api(api)
    admission: Any = client.AdmissionregistrationV1Api(api)
    made: list[tuple[Any, str]] = []
    if granular:
        rendered = run(
            str(installed / "helm"),
            "template",
            RELEASE,
            str(REPO_ROOT / "charts/flexgpu"),
            "--namespace",
            NS,
            "--set",
            "kubeletPlugin.claimStatusAdmissionPolicy=always",
            "--show-only",
            "templates/claim-status-admission-policy.yaml",
            kubeconfig=cluster.kubeconfig,
        )
        assert rendered.returncode == 0, rendered.stderr
        policy, binding = [d for d in yaml.safe_load_all(rendered.stdout) if d]
        admission.create_validating_admission_policy(policy)
        made.append((admission.delete_validating_admission_policy, CLAIM_STATUS_POLICY))
        admission.create_validating_admission_policy_binding(binding)
        made.append((admission.delete_validating_admission_policy_binding, CLAIM_STATUS_POLICY))
        wider = "attack-test-any-claim-status"
        rbac.create_cluster_role(
            {
                "metadata": {"name": wider},
                "rules": [
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims/driver"],
                        "verbs": ["arbitrary-node:patch", "associated-node:patch"],
                    },
                    {
                        "apiGroups": ["resource.k8s.io"],
                        "resources": ["resourceclaims/binding"],
                        "verbs": ["patch"],
                    },
                ],
            }
        )
        made.append((rbac.delete_cluster_role, wider))
        rbac.create_cluster_role_binding(
            {
                "metadata": {"name": wider},
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": wider,
                },
                "subjects": [{"kind": "ServiceAccount", "name": PLUGIN_SA, "namespace": NS}],
            }
        )
        made.append((rbac.delete_cluster_role_binding, wider))
    try:
        _assert_refused_by_the_policy(_status_attacks(cluster, api, namespace, policy_only=True))
    finally:
        for delete, name in reversed(made):
            delete(name)


# --------------------------------------------------------------------------- controller


@pytest.mark.core
def test_controller_reaches_only_its_own_secret_and_lease(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    core_admin: Any = client.CoreV1Api(api)
    releases = [
        s.metadata.name
        for s in core_admin.list_namespaced_secret(NS, label_selector="owner=helm").items
    ]
    assert releases, "helm keeps its release in a Secret"
    helm_secret = releases[0]
    as_controller = _controller(cluster, api)
    core: Any = client.CoreV1Api(as_controller)
    coordination: Any = client.CoordinationV1Api(as_controller)
    stolen = {"metadata": {"name": "not-the-webhook-tls"}, "data": {"x": "eA=="}}
    _policies_loaded(core.create_namespaced_secret, NS, stolen)
    lease = {"metadata": {"name": "another-products-leader"}, "spec": {"holderIdentity": "me"}}
    rows = {
        "read the helm release": lambda: core.read_namespaced_secret(helm_secret, NS),
        "list Secrets": lambda: core.list_namespaced_secret(NS),
        "update the helm release": lambda: core.patch_namespaced_secret(
            helm_secret, NS, {"metadata": {"labels": {"x": "y"}}}
        ),
        "create another Secret": lambda: core.create_namespaced_secret(NS, stolen),
        "delete its own Secret": lambda: core.delete_namespaced_secret(
            f"{RELEASE}-webhook-tls", NS
        ),
        "read Secrets elsewhere": lambda: core.read_namespaced_secret("any", "kube-system"),
        "create another Lease": lambda: coordination.create_namespaced_lease(NS, lease),
        "take another Lease": lambda: coordination.read_namespaced_lease(
            "another-products-leader", NS
        ),
    }
    refused = {what: _denial(call) for what, call in rows.items()}
    assert (
        f"may only create its own secrets ({RELEASE}-webhook-tls), not 'not-the-webhook-tls'"
        in refused["create another Secret"]
    )
    # Its own: readable (absent until it runs: 404, not 403) and its Lease creatable.
    try:
        core.read_namespaced_secret(f"{RELEASE}-webhook-tls", NS)
    except client.ApiException as error:
        assert error.status == 404, error
    own_lease = {"metadata": {"name": f"{RELEASE}-controller"}, "spec": {"holderIdentity": "me"}}
    try:
        coordination.create_namespaced_lease(NS, own_lease, dry_run="All")
    except client.ApiException as error:
        assert error.status == 409, error  # admitted; it exists already


def _hook_index(stored: Any, name: str) -> int:
    return next(i for i, w in enumerate(stored.webhooks) if w.name == name)


@pytest.mark.core
def test_controller_cannot_redirect_or_widen_its_webhooks(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """With the controller's token its webhook configuration cannot be pointed elsewhere,
    given its own CA, widened to all DRA writes or made to fail them: only caBundle may
    change."""
    admin: Any = client.AdmissionregistrationV1Api(api)
    stored = admin.read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
    as_controller: Any = client.AdmissionregistrationV1Api(_controller(cluster, api))
    claims = _hook_index(stored, "resourceclaims.gpu.flexgpu.dev")
    hook = f"/webhooks/{claims}"
    attacker_ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n").decode()

    def patch(ops: list[dict[str, Any]], **kwargs: Any) -> Any:
        return as_controller.patch_validating_webhook_configuration(
            WEBHOOK_CONFIGURATION, ops, **kwargs
        )

    redirect = [
        {"op": "remove", "path": f"{hook}/clientConfig/service"},
        {"op": "add", "path": f"{hook}/clientConfig/url", "value": "https://203.0.113.7/x"},
    ]
    fail_all = [
        {"op": "replace", "path": f"{hook}/failurePolicy", "value": "Fail"},
        {
            "op": "replace",
            "path": f"{hook}/rules",
            "value": [
                {
                    "apiGroups": ["resource.k8s.io"],
                    "apiVersions": ["*"],
                    "operations": ["*"],
                    "resources": ["*/*"],
                }
            ],
        },
    ]
    _policies_loaded(patch, redirect)
    service = f"{hook}/clientConfig/service"
    rows: dict[str, list[dict[str, Any]]] = {
        "url of its own choosing": redirect,
        "url with its own CA": [
            *redirect,
            {"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca},
        ],
        "another Service": [{"op": "replace", "path": f"{service}/name", "value": "kube-dns"}],
        "another namespace": [
            {"op": "replace", "path": f"{service}/namespace", "value": "kube-system"}
        ],
        "another path": [{"op": "replace", "path": f"{service}/path", "value": "/anything"}],
        "another port": [{"op": "replace", "path": f"{service}/port", "value": 8443}],
        "another Service with its own CA": [
            {"op": "replace", "path": f"{service}/name", "value": "kube-dns"},
            {"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca},
        ],
        "failurePolicy Fail over all of resource.k8s.io": fail_all,
        "failurePolicy Fail": [fail_all[0]],
        "longer timeout": [{"op": "replace", "path": f"{hook}/timeoutSeconds", "value": 30}],
        "every namespace": [{"op": "remove", "path": f"{hook}/namespaceSelector"}],
        "every claim": [{"op": "remove", "path": f"{hook}/matchConditions"}],
        "a webhook more": [
            {
                "op": "add",
                "path": "/webhooks/-",
                "value": {
                    **client.ApiClient().sanitize_for_serialization(stored.webhooks[claims]),
                    "name": "slices.gpu.flexgpu.dev",
                },
            }
        ],
        "a webhook less": [{"op": "remove", "path": hook}],
        "Helm's ownership": [
            {
                "op": "remove",
                "path": "/metadata/annotations/meta.helm.sh~1release-name",
            }
        ],
    }
    for what, ops in rows.items():
        message = _denial(patch, ops)
        assert "may only set clientConfig.caBundle of its webhooks" in message, what
    after = admin.read_validating_webhook_configuration(WEBHOOK_CONFIGURATION)
    assert after.metadata.resource_version == stored.metadata.resource_version
    # Its job: the caBundle alone (dry run, so the controller's own bundle stays).
    patch(
        [{"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca}],
        dry_run="All",
    )


TENANCY_CONFIGURATION = f"{RELEASE}-tenancy"


@pytest.mark.core
def test_controller_cannot_redirect_widen_or_drop_its_tenancy_webhooks(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """The tenancy MutatingWebhookConfiguration (it adds the per-namespace selector to
    shared-GPU claims) is pinned as the validating one is: with the controller's token it can
    be neither pointed elsewhere nor given the attacker's CA (it would receive, and could
    rewrite, every namespace's claims), nor made to fail or widened to all DRA writes, nor
    narrowed so that claims escape the selector; it cannot be deleted and no other mutating
    configuration can be made. Only caBundle may change."""
    admin: Any = client.AdmissionregistrationV1Api(api)
    stored = admin.read_mutating_webhook_configuration(TENANCY_CONFIGURATION)
    as_controller: Any = client.AdmissionregistrationV1Api(_controller(cluster, api))
    hook = f"/webhooks/{_hook_index(stored, 'tenancy.resourceclaims.gpu.flexgpu.dev')}"
    service = f"{hook}/clientConfig/service"
    attacker_ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n").decode()

    def patch(ops: list[dict[str, Any]], **kwargs: Any) -> Any:
        return as_controller.patch_mutating_webhook_configuration(
            TENANCY_CONFIGURATION, ops, **kwargs
        )

    redirect = [
        {"op": "remove", "path": service},
        {"op": "add", "path": f"{hook}/clientConfig/url", "value": "https://203.0.113.7/x"},
    ]
    every_dra_write = [
        {
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["*"],
            "resources": ["*/*"],
        }
    ]
    fail = {"op": "replace", "path": f"{hook}/failurePolicy", "value": "Fail"}
    _policies_loaded(patch, redirect)
    rows: dict[str, list[dict[str, Any]]] = {
        "url of its own choosing": redirect,
        "url with its own CA": [
            *redirect,
            {"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca},
        ],
        "another Service": [{"op": "replace", "path": f"{service}/name", "value": "kube-dns"}],
        "another path": [{"op": "replace", "path": f"{service}/path", "value": "/anything"}],
        "failurePolicy Fail over all of resource.k8s.io": [
            fail,
            {"op": "replace", "path": f"{hook}/rules", "value": every_dra_write},
        ],
        "failurePolicy Fail": [fail],
        "rules widened": [{"op": "replace", "path": f"{hook}/rules", "value": every_dra_write}],
        "every claim, not only shared-GPU ones": [
            {"op": "remove", "path": f"{hook}/matchConditions"}
        ],
        "no claim (the selector dropped)": [
            {
                "op": "replace",
                "path": f"{hook}/matchConditions/0/expression",
                "value": "false",
            }
        ],
        "some namespaces left out": [
            {
                "op": "add",
                "path": f"{hook}/namespaceSelector",
                "value": {"matchLabels": {"team": "trusted"}},
            }
        ],
        "not reinvoked": [
            {"op": "replace", "path": f"{hook}/reinvocationPolicy", "value": "Never"}
        ],
        "longer timeout": [{"op": "replace", "path": f"{hook}/timeoutSeconds", "value": 30}],
        "a webhook less": [{"op": "remove", "path": hook}],
    }
    for what, ops in rows.items():
        message = _denial(patch, ops)
        assert "may only set clientConfig.caBundle of its webhooks" in message, what
    # RBAC: no delete, and no other mutating configuration (which could rewrite anything).
    _denial(as_controller.delete_mutating_webhook_configuration, TENANCY_CONFIGURATION)
    other = client.ApiClient().sanitize_for_serialization(stored)
    other["metadata"] = {"name": "flexgpu-anything"}
    _denial(as_controller.create_mutating_webhook_configuration, other)
    after = admin.read_mutating_webhook_configuration(TENANCY_CONFIGURATION)
    assert after.metadata.resource_version == stored.metadata.resource_version
    # Its job: the caBundle alone (dry run, so the controller's own bundle stays).
    patch(
        [{"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca}],
        dry_run="All",
    )


TOLERATIONS_CONFIGURATION = f"{RELEASE}-gpu-tolerations"


def test_controller_cannot_widen_or_redirect_its_pod_toleration_webhook(
    cluster: ControlPlane, api: Any, installed: Path
) -> None:
    """The pod toleration MutatingWebhookConfiguration sees pod creations, so it is pinned
    like the others: with the controller's token it cannot be pointed elsewhere, widened from
    pods to other core resources (Secrets, ConfigMaps) or all operations, made to fail every
    pod, sent every pod (match conditions) or every namespace's (the opt-out selector), or
    deleted. Only caBundle may change. The controller still may neither write pods nor list
    every namespace's claim templates: the webhook reads the one template a pod names."""
    admin: Any = client.AdmissionregistrationV1Api(api)
    stored = admin.read_mutating_webhook_configuration(TOLERATIONS_CONFIGURATION)
    controller_api = _controller(cluster, api)
    as_controller: Any = client.AdmissionregistrationV1Api(controller_api)
    hook = f"/webhooks/{_hook_index(stored, 'tolerations.pods.gpu.flexgpu.dev')}"
    service = f"{hook}/clientConfig/service"

    def patch(ops: list[dict[str, Any]], **kwargs: Any) -> Any:
        return as_controller.patch_mutating_webhook_configuration(
            TOLERATIONS_CONFIGURATION, ops, **kwargs
        )

    redirect = [
        {"op": "remove", "path": service},
        {"op": "add", "path": f"{hook}/clientConfig/url", "value": "https://203.0.113.7/x"},
    ]
    _policies_loaded(patch, redirect)
    secrets_too = [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE", "UPDATE"],
            "resources": ["pods", "secrets", "configmaps"],
        }
    ]
    rows: dict[str, list[dict[str, Any]]] = {
        "url of its own choosing": redirect,
        "another path": [{"op": "replace", "path": f"{service}/path", "value": "/anything"}],
        "Secrets and ConfigMaps too": [
            {"op": "replace", "path": f"{hook}/rules", "value": secrets_too}
        ],
        "failurePolicy Fail": [{"op": "replace", "path": f"{hook}/failurePolicy", "value": "Fail"}],
        "every pod, not only those with claims": [
            {"op": "remove", "path": f"{hook}/matchConditions"}
        ],
        "the namespace opt-out dropped": [{"op": "remove", "path": f"{hook}/namespaceSelector"}],
        "a webhook less": [{"op": "remove", "path": hook}],
    }
    for what, ops in rows.items():
        message = _denial(patch, ops)
        assert "may only set clientConfig.caBundle of its webhooks" in message, what
    _denial(as_controller.delete_mutating_webhook_configuration, TOLERATIONS_CONFIGURATION)
    after = admin.read_mutating_webhook_configuration(TOLERATIONS_CONFIGURATION)
    assert after.metadata.resource_version == stored.metadata.resource_version
    # Its reads: one named template (allowed), never a list of every namespace's, nor a pod
    # write of its own.
    resources: Any = client.ResourceV1Api(controller_api)
    with pytest.raises(client.ApiException) as missing:
        resources.read_namespaced_resource_claim_template("no-such-template", "default")
    assert missing.value.status == 404
    _denial(resources.list_resource_claim_template_for_all_namespaces)
    pod = {"metadata": {"name": "attacker"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    _denial(client.CoreV1Api(controller_api).create_namespaced_pod, "default", pod)
    # Its job: the caBundle alone (dry run, so the controller's own bundle stays).
    attacker_ca = base64.b64encode(b"-----BEGIN CERTIFICATE-----\nAAAA\n").decode()
    patch(
        [{"op": "add", "path": f"{hook}/clientConfig/caBundle", "value": attacker_ca}],
        dry_run="All",
    )
