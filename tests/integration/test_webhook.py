"""The validating admission webhook against the real apiserver: the webhook runs as a local
process (``python -m flexgpu.controller.admission_server``), reached at an https://127.0.0.1
URL, and every check goes through real creates (and one real ``kubectl apply``)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client

from flexgpu.controller.webhook_config import CONFIGURATION_NAME
from tests.conftest import wait_for
from tests.integration.webhook_process import WebhookProcess, run_webhook_for_tests
from tools.cluster import ControlPlane

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "flexgpu.dev_gpunodepolicies.yaml"
SECRET_NAME = "flexgpu-webhook-tls"

GPU = {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "GpuConfig"}
MIG = {"apiVersion": "gpu.flexgpu.dev/v1alpha1", "kind": "MigConfig"}
PARAMS = "spec.devices.config[0].opaque.parameters"
QUANTITY = 'a Kubernetes quantity of whole bytes greater than 0, e.g. "10Gi"'
DENIED = 'admission webhook "{}" denied the request: '
CLAIMS_WEBHOOK = "resourceclaims.gpu.flexgpu.dev"


def mps(**limits: Any) -> dict[str, Any]:
    return {**GPU, "sharing": {"strategy": "MPS", "mpsConfig": limits}}


def claim_spec(
    parameters: Any,
    device_class: str = "gpu.flexgpu.dev",
    requests: list[str] | None = None,
    driver: str = "gpu.flexgpu.dev",
) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        entry["requests"] = requests
    return {
        "devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}],
            "config": [entry],
        }
    }


def burstable_spec(compute: str, limit: int) -> dict[str, Any]:
    """A fraction reserving ``compute`` percent of SMs with ``share.computeLimit``."""
    spec = claim_spec({**GPU, "share": {"computeLimit": limit}}, "shared-gpu.flexgpu.dev", ["gpu"])
    exactly = spec["devices"]["requests"][0]["exactly"]
    exactly["capacity"] = {"requests": {"memory": "4Gi", "compute": compute}}
    return spec


def claim(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": spec,
    }


BAD_CONFIGS: list[tuple[str, dict[str, Any], str]] = [
    # Prepare refuses both, so admission does (same text).
    (
        "time-slicing-a-shared-gpu",
        claim_spec(
            {**GPU, "sharing": {"strategy": "TimeSlicing"}}, "shared-gpu.flexgpu.dev", ["gpu"]
        ),
        f'{PARAMS}.sharing.strategy: "TimeSlicing" is not supported on a shared GPU (request '
        '"gpu"; a share is enforced with MPS); allowed: Exclusive, MPS',
    ),
    (
        "multi-user-mps-on-a-mig-device",
        claim_spec(
            {**MIG, "sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}},
            "mig.flexgpu.dev",
            ["gpu"],
        ),
        f"{PARAMS}.sharing.mpsConfig.multiUser: true is not supported: NVIDIA's DRA driver has "
        "no such setting, and the MPS control daemon flexgpu starts (MPS protocol 2) has no "
        "multi-user mode: it runs one MPS server per Linux user at a time, and clients of "
        "another user wait until that server exits (only the opt-in MPS v3 interface has a "
        "--multiuser flag, which flexgpu does not run); allowed: false, or leave it out and run "
        "the claim's containers as one user",
    ),
    (
        "wrong-kind-for-mig-class",
        claim_spec(GPU, "mig.flexgpu.dev", ["gpu"]),
        'spec.devices.config[0]: request "gpu": GpuConfig cannot configure a MIG device; '
        "use MigConfig",
    ),
    (
        "wrong-kind-for-shared-class",
        claim_spec(MIG, "shared-gpu.flexgpu.dev", ["gpu"]),
        'spec.devices.config[0]: request "gpu": MigConfig cannot configure a shared GPU; '
        "use GpuConfig",
    ),
    (
        "unknown-field",
        claim_spec(mps(defaultActiveThreadPercentag=50)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentag: unknown field; allowed: "
        "defaultActiveThreadPercentage, defaultPinnedDeviceMemoryLimit, "
        "defaultPerDevicePinnedMemoryLimit, multiUser",
    ),
    (
        "percentage-0",
        claim_spec(mps(defaultActiveThreadPercentage=0)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentage: 0 is not allowed; "
        "allowed: an integer from 1 to 100",
    ),
    (
        "percentage-101",
        claim_spec(mps(defaultActiveThreadPercentage=101)),
        f"{PARAMS}.sharing.mpsConfig.defaultActiveThreadPercentage: 101 is not allowed; "
        "allowed: an integer from 1 to 100",
    ),
    (
        "negative-quantity",
        claim_spec(mps(defaultPinnedDeviceMemoryLimit="-1Gi")),
        f'{PARAMS}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "-1Gi" is not allowed; '
        f"allowed: {QUANTITY}",
    ),
    (
        "malformed-quantity",
        claim_spec(mps(defaultPinnedDeviceMemoryLimit="10GB")),
        f'{PARAMS}.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10GB" is not allowed '
        f'(unknown suffix "GB"); allowed: {QUANTITY}',
    ),
    (
        "both-sharing-blocks",
        claim_spec(
            {
                **GPU,
                "sharing": {
                    "strategy": "TimeSlicing",
                    "timeSlicingConfig": {"interval": "Short"},
                    "mpsConfig": {"defaultActiveThreadPercentage": 50},
                },
            }
        ),
        f"{PARAMS}.sharing: timeSlicingConfig and mpsConfig together are not allowed; allowed: "
        "timeSlicingConfig with strategy TimeSlicing, or mpsConfig with strategy MPS",
    ),
    (
        "wrong-api-version",
        claim_spec({**GPU, "apiVersion": "resource.nvidia.com/v1beta1"}),
        f'{PARAMS}.apiVersion: "resource.nvidia.com/v1beta1" is not allowed; allowed: '
        "gpu.flexgpu.dev/v1alpha1",
    ),
    # A burstable fraction's limit below what its request reserves; its block on a whole GPU.
    (
        "compute-limit-below-the-request",
        burstable_spec("30", 20),
        f"{PARAMS}.share.computeLimit: 20 is not allowed (below the 30 percent of SMs request "
        '"gpu" reserves); allowed: an integer from 30 to 100',
    ),
    (
        "share-block-on-a-whole-gpu",
        claim_spec({**GPU, "share": {"computeLimit": 50}}, "gpu.flexgpu.dev", ["gpu"]),
        f'{PARAMS}.share: not supported on a whole GPU (request "gpu"; the block sets a '
        "fraction's limits); allowed: only on a shared GPU (shared-gpu.flexgpu.dev); an MPS "
        "client of a whole GPU is capped with sharing.mpsConfig.defaultActiveThreadPercentage",
    ),
]

GOOD_CONFIGS: list[dict[str, Any]] = [
    claim_spec(GPU),
    burstable_spec("30", 80),
    claim_spec(mps(defaultActiveThreadPercentage=50, defaultPinnedDeviceMemoryLimit="10Gi")),
    claim_spec({**GPU, "sharing": {"strategy": "MPS"}}, "shared-gpu.flexgpu.dev", ["gpu"]),
    claim_spec({**MIG, "sharing": {"strategy": "Exclusive"}}, "mig.flexgpu.dev", ["gpu"]),
    claim_spec(
        {**MIG, "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 1}}},
        "mig.flexgpu.dev",
        ["gpu"],
    ),
]
BAD_POLICY_SPEC = {"gpus": [{"selector": {"all": True}, "mode": "MIG", "migLayout": {"1g10gb": 7}}]}
BAD_POLICY_MESSAGE = (
    'spec.gpus[0].migLayout: key "1g10gb" is not allowed; allowed: a MIG profile name such as '
    '"1g.10gb", "1g.10gb+me" or "3g.40gb"'
)


def _unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _message(error: client.ApiException) -> str:
    return str(json.loads(error.body)["message"])


class Webhook:
    """The webhook process of this module; ``stop()`` and ``start()`` for the outage test."""

    def __init__(self, cluster: ControlPlane, api: Any, workdir: Path) -> None:
        self.cluster = cluster
        self.api = api
        self.workdir = workdir
        self.secret_namespace = _unique("flexgpu-wh")
        self.process: WebhookProcess | None = None
        self._stack: ExitStack | None = None
        self.log = workdir / "webhook.log"

    def start(self) -> None:
        self._stack = ExitStack()
        self.process = self._stack.enter_context(
            run_webhook_for_tests(
                self.cluster.kubeconfig,
                self.log,
                secret_namespace=self.secret_namespace,
                secret_name=SECRET_NAME,
            )
        )
        self.wait_until_enforced()

    def stop(self) -> None:
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def wait_until_enforced(self) -> None:
        """The apiserver loads a new configuration a moment after it is written."""
        resources = client.ResourceV1Api(self.api)
        probe = claim(_unique("probe"), claim_spec(mps(defaultActiveThreadPercentage=0)))

        def rejected() -> bool:
            try:
                resources.create_namespaced_resource_claim("default", probe, dry_run="All")
            except client.ApiException as error:
                return "denied the request" in _message(error)
            return False

        wait_for(rejected, timeout_s=30, what="the webhook to be enforced")

    def requests_served(self, path: str) -> int:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return len(re.findall(rf'"POST /{path}\?', text))


@pytest.fixture(scope="module")
def policy_crd_served(api: Any) -> bool:
    if not CRD_FILE.exists():
        return False
    manifest = yaml.safe_load(CRD_FILE.read_text())
    extensions = client.ApiextensionsV1Api(api)
    try:
        extensions.create_custom_resource_definition(manifest)
    except client.ApiException as error:
        if error.status != 409:
            raise
    objects = client.CustomObjectsApi(api)

    def listable() -> bool:
        try:
            objects.list_cluster_custom_object("flexgpu.dev", "v1alpha1", "gpunodepolicies")
        except client.ApiException:
            return False
        return True

    wait_for(listable, what="gpunodepolicies served")
    return True


@pytest.fixture(scope="module")
def webhook(
    cluster: ControlPlane,
    api: Any,
    policy_crd_served: bool,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Webhook]:
    core = client.CoreV1Api(api)
    running = Webhook(cluster, api, tmp_path_factory.mktemp("webhook"))
    core.create_namespace(
        client.V1Namespace(metadata=client.V1ObjectMeta(name=running.secret_namespace))
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()
        admission = client.AdmissionregistrationV1Api(api)
        try:
            admission.delete_validating_webhook_configuration(CONFIGURATION_NAME)
        except client.ApiException as error:
            if error.status != 404:
                raise
        core.delete_namespace(running.secret_namespace)


@pytest.fixture
def claims(api: Any, namespace: str) -> Any:
    resources = client.ResourceV1Api(api)

    def create(spec: dict[str, Any]) -> Any:
        return resources.create_namespaced_resource_claim(namespace, claim(_unique("c"), spec))

    return create


def _rejection(create: Any, *args: Any) -> str:
    with pytest.raises(client.ApiException) as caught:
        create(*args)
    assert caught.value.status == 422, _message(caught.value)
    return _message(caught.value)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [(spec, expected) for _, spec, expected in BAD_CONFIGS],
    ids=[name for name, _, _ in BAD_CONFIGS],
)
def test_bad_config_is_rejected_with_its_exact_message(
    webhook: Webhook, claims: Any, spec: dict[str, Any], expected: str
) -> None:
    assert _rejection(claims, spec) == DENIED.format(CLAIMS_WEBHOOK) + expected


def test_every_problem_is_listed(webhook: Webhook, claims: Any) -> None:
    spec = claim_spec({**GPU, "sharing": {"strategy": "Shared", "foo": 1}})
    assert _rejection(claims, spec) == DENIED.format(CLAIMS_WEBHOOK) + (
        "2 problems:\n"
        f'- {PARAMS}.sharing.strategy: "Shared" is not allowed; allowed: Exclusive, '
        "TimeSlicing, MPS\n"
        f"- {PARAMS}.sharing.foo: unknown field; allowed: strategy, timeSlicingConfig, mpsConfig"
    )


def test_good_configs_are_accepted(webhook: Webhook, claims: Any) -> None:
    for spec in GOOD_CONFIGS:
        created = claims(spec)
        assert created.spec.devices.config[0].opaque.driver == "gpu.flexgpu.dev"


def test_templates(webhook: Webhook, api: Any, namespace: str) -> None:
    resources = client.ResourceV1Api(api)

    def create(spec: dict[str, Any]) -> Any:
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": _unique("t")},
            "spec": {"spec": spec},
        }
        return resources.create_namespaced_resource_claim_template(namespace, body)

    create(claim_spec(GPU))
    assert _rejection(create, claim_spec(mps(defaultPinnedDeviceMemoryLimit="-1Gi"))) == (
        DENIED.format("resourceclaimtemplates.gpu.flexgpu.dev")
        + "spec.spec.devices.config[0].opaque.parameters.sharing.mpsConfig."
        f'defaultPinnedDeviceMemoryLimit: "-1Gi" is not allowed; allowed: {QUANTITY}'
    )


def test_device_classes(webhook: Webhook, api: Any) -> None:
    resources = client.ResourceV1Api(api)
    names: list[str] = []

    def create(parameters: Any, driver: str = "gpu.flexgpu.dev") -> Any:
        name = _unique("flexgpu-test-class")
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": name},
            "spec": {"config": [{"opaque": {"driver": driver, "parameters": parameters}}]},
        }
        created = resources.create_device_class(body)
        names.append(name)
        return created

    try:
        create({**GPU, "sharing": {"strategy": "TimeSlicing"}})
        create({"anything": "goes"}, driver="other.example.com")
        assert _rejection(create, {**MIG, "sharing": {"strategy": "Spread"}}) == (
            DENIED.format("deviceclasses.gpu.flexgpu.dev")
            + 'spec.config[0].opaque.parameters.sharing.strategy: "Spread" is not allowed; '
            "allowed: Exclusive, TimeSlicing, MPS"
        )
    finally:
        for name in names:
            resources.delete_device_class(name)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH")
def test_kubectl_apply_shows_the_rejection(
    webhook: Webhook, cluster: ControlPlane, namespace: str, tmp_path: Path
) -> None:
    name, spec, expected = BAD_CONFIGS[6]
    manifest = tmp_path / "claim.yaml"
    manifest.write_text(yaml.safe_dump(claim(name, spec)))
    result = subprocess.run(
        ["kubectl", f"--kubeconfig={cluster.kubeconfig}", "-n", namespace, "apply", "-f", manifest],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode != 0
    assert DENIED.format(CLAIMS_WEBHOOK) + expected in result.stderr


def test_claims_of_other_drivers_never_reach_the_webhook(webhook: Webhook, claims: Any) -> None:
    before = webhook.requests_served("resourceclaims")
    claims(claim_spec({"whatever": 1}, "gpu.nvidia.com", driver="gpu.nvidia.com"))
    claims({"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "x"}}]}})
    claims(claim_spec(mps(defaultActiveThreadPercentage=50)))  # ours: reaches it
    wait_for(lambda: webhook.requests_served("resourceclaims") >= before + 1, timeout_s=10)
    assert webhook.requests_served("resourceclaims") == before + 1


def test_a_half_migrated_claim_is_refused_with_the_fix(webhook: Webhook, claims: Any) -> None:
    """NVIDIA's driver name left on the config of a claim for flexgpu's class: the apiserver
    sends it to the webhook, which refuses it (no driver would read that config)."""
    before = webhook.requests_served("resourceclaims")
    message = _rejection(
        claims, claim_spec(mps(defaultActiveThreadPercentage=50), driver="gpu.nvidia.com")
    )
    assert "spec.devices.config[0].opaque.driver: 'gpu.nvidia.com' is read by no driver" in message
    assert "set opaque.driver to 'gpu.flexgpu.dev'" in message
    wait_for(lambda: webhook.requests_served("resourceclaims") >= before + 1, timeout_s=10)


def test_bad_node_policy_is_rejected(webhook: Webhook, api: Any, policy_crd_served: bool) -> None:
    if not policy_crd_served:
        pytest.skip("crds/flexgpu.dev_gpunodepolicies.yaml is not generated yet")
    objects = client.CustomObjectsApi(api)
    name = _unique("wh-policy")
    body = {
        "apiVersion": "flexgpu.dev/v1alpha1",
        "kind": "GpuNodePolicy",
        "metadata": {"name": name},
        "spec": BAD_POLICY_SPEC,
    }
    message = _rejection(
        objects.create_cluster_custom_object, "flexgpu.dev", "v1alpha1", "gpunodepolicies", body
    )
    assert message == DENIED.format("gpunodepolicies.flexgpu.dev") + BAD_POLICY_MESSAGE
    body["spec"] = {"gpus": [{"selector": {"all": True}, "mode": "Whole"}]}
    objects.create_cluster_custom_object("flexgpu.dev", "v1alpha1", "gpunodepolicies", body)
    objects.delete_cluster_custom_object("flexgpu.dev", "v1alpha1", "gpunodepolicies", name)


# Last: stops and restarts the webhook.
def test_outage_blocks_nothing_but_policy_edits_and_restart_reuses_the_secret(
    webhook: Webhook, api: Any, claims: Any, policy_crd_served: bool
) -> None:
    core = client.CoreV1Api(api)
    secret = core.read_namespaced_secret(SECRET_NAME, webhook.secret_namespace)
    configuration = client.AdmissionregistrationV1Api(api).read_validating_webhook_configuration(
        CONFIGURATION_NAME
    )
    ca_bundle = base64.b64decode(configuration.webhooks[0].client_config.ca_bundle)
    assert ca_bundle == base64.b64decode(secret.data["ca-bundle.crt"])

    webhook.stop()
    # Another driver's claim is never sent to the webhook; ours is (failurePolicy Ignore) and
    # is admitted: prepare runs the same checks, so it cannot take effect anyway.
    claims(claim_spec({"whatever": 1}, "gpu.nvidia.com", driver="gpu.nvidia.com"))
    claims(claim_spec(mps(defaultActiveThreadPercentage=0)))
    if policy_crd_served:
        objects = client.CustomObjectsApi(api)
        body = {
            "apiVersion": "flexgpu.dev/v1alpha1",
            "kind": "GpuNodePolicy",
            "metadata": {"name": _unique("wh-policy")},
            "spec": {"gpus": [{"selector": {"all": True}, "mode": "Whole"}]},
        }
        with pytest.raises(client.ApiException) as caught:
            objects.create_cluster_custom_object("flexgpu.dev", "v1alpha1", "gpunodepolicies", body)
        assert 'failed calling webhook "gpunodepolicies.flexgpu.dev"' in _message(caught.value)

    webhook.start()
    again = core.read_namespaced_secret(SECRET_NAME, webhook.secret_namespace)
    assert again.data == secret.data
    assert again.metadata.resource_version == secret.metadata.resource_version
    _rejection(claims, claim_spec(mps(defaultActiveThreadPercentage=0)))
