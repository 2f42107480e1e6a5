"""Device metadata (KEP-5304) as a container reads it: the paths, the JSON stream of one
object per API version, each device's attributes; and, against the upstream Go module pinned
in tools/k8s/go.mod, that every name, version and field is upstream's."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from flexgpu.driver.cdi import (
    METADATA_MOUNT_OPTIONS,
    CdiDevice,
    ClaimIdentity,
    MetadataMount,
    metadata_device_id,
    metadata_requests,
    minimum_cdi_version,
    render_claim_spec,
)
from flexgpu.driver.device_metadata import (
    CLAIMS_SUBDIR,
    CONTAINER_DIR,
    FILE_SUFFIX,
    GROUP,
    KIND,
    MAX_ATTRIBUTES,
    POD_CLAIM_NAME_ANNOTATION,
    TEMPLATES_SUBDIR,
    VERSIONS,
    MetadataClaim,
    MetadataDevice,
    container_path,
    decode_metadata,
    device_attributes,
    encode_metadata,
    render_metadata,
)
from flexgpu.driver.quantity import parse_quantity
from tests.go_modules import module_dir

CLAIM = MetadataClaim("0b5e8c1a-7d2f-4e3b-9a61-2c4d5e6f7a8b", "team-a", "train")
FROM_TEMPLATE = MetadataClaim(
    "5c6d7e8f-0a1b-4c2d-8e3f-4a5b6c7d8e9f", "team-a", "pod-1-gpu-x7k2p", "gpu"
)
GPU = MetadataDevice(
    "node-a",
    "gpu-0",
    {
        "uuid": {"string": "GPU-11111111-2222-3333-4444-555555555555"},
        "productName": {"string": "NVIDIA H100 80GB HBM3"},
        "driverVersion": {"version": "580.95.5"},
        "migCapable": {"bool": True},
        "index": {"int": 0},
        "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
    },
)
SKIP_ENV = "FLEXGPU_SKIP_UPSTREAM_METADATA"
DRA_MODULE = "k8s.io/dynamic-resource-allocation"


def _objects(data: bytes) -> list[dict[str, Any]]:
    return decode_metadata(data)


def test_a_claim_named_in_the_pod_reads_its_file_under_its_name() -> None:
    assert container_path(CLAIM, "gpu") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/train/gpu/"
        "gpu.flexgpu.dev-metadata.json"
    )


def test_a_template_claim_reads_its_file_under_the_pods_name_for_it() -> None:
    assert container_path(FROM_TEMPLATE, "gpu") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu/gpu/"
        "gpu.flexgpu.dev-metadata.json"
    )


def test_a_subrequest_reads_the_file_of_its_request_and_is_named_in_it() -> None:
    assert container_path(CLAIM, "gpu/h100").endswith(
        "/resourceclaims/train/gpu/" + "gpu.flexgpu.dev-metadata.json"
    )
    (first, _) = _objects(encode_metadata(render_metadata(CLAIM, "gpu/h100", [GPU])))
    assert first["requests"][0]["name"] == "gpu/h100"


def test_the_file_holds_one_object_per_version_newest_first() -> None:
    data = encode_metadata(render_metadata(CLAIM, "gpu", [GPU]))
    objects = _objects(data)
    assert [o["apiVersion"] for o in objects] == [
        "metadata.resource.k8s.io/v1beta1",
        "metadata.resource.k8s.io/v1alpha1",
    ]
    assert {o["kind"] for o in objects} == {"DeviceMetadata"}
    # Apart from the version, the objects are the same.
    assert len({json.dumps({**o, "apiVersion": ""}, sort_keys=True) for o in objects}) == 1
    # Each object is followed by a newline; a line-oriented reader finds where each ends.
    assert data.endswith(b"}\n") and data.count(b"\n}\n") == 2


def test_an_object_carries_the_claim_its_request_and_its_devices() -> None:
    (obj, _) = _objects(encode_metadata(render_metadata(CLAIM, "gpu", [GPU])))
    assert obj["metadata"] == {
        "name": "train",
        "namespace": "team-a",
        "uid": CLAIM.uid,
        "generation": 1,
    }
    assert "podClaimName" not in obj
    (request,) = obj["requests"]
    assert request["name"] == "gpu"
    (device,) = request["devices"]
    assert device["driver"] == "gpu.flexgpu.dev"
    assert (device["pool"], device["name"]) == ("node-a", "gpu-0")
    assert device["attributes"]["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert "networkData" not in device


def test_a_template_claim_names_the_pods_name_for_it() -> None:
    (obj, _) = _objects(encode_metadata(render_metadata(FROM_TEMPLATE, "gpu", [GPU])))
    assert obj["podClaimName"] == "gpu"
    assert obj["metadata"]["name"] == "pod-1-gpu-x7k2p"


def test_fields_come_in_the_go_encoders_order_attributes_sorted() -> None:
    text = encode_metadata(render_metadata(FROM_TEMPLATE, "gpu", [GPU])).decode()
    first = text[: text.index("\n}\n") + 3]
    keys = re.findall(r'^\s*"([^"]+)":', first, re.M)
    assert keys[:9] == [
        "kind",
        "apiVersion",
        "metadata",
        "name",
        "namespace",
        "uid",
        "generation",
        "podClaimName",
        "requests",
    ]
    attributes = list(json.loads(first)["requests"][0]["devices"][0]["attributes"])
    assert attributes == sorted(attributes)
    assert first.startswith('{\n  "kind": "DeviceMetadata",\n  "apiVersion": ')


def test_html_characters_are_escaped_as_the_go_encoder_escapes_them() -> None:
    odd = MetadataDevice("node-a", "gpu-0", {"productName": {"string": "A<B>&C"}})
    data = encode_metadata(render_metadata(CLAIM, "gpu", [odd]))
    assert b"A\\u003cB\\u003e\\u0026C" in data
    assert _objects(data)[0]["requests"][0]["devices"][0]["attributes"]["productName"] == {
        "string": "A<B>&C"
    }


def test_attributes_are_the_published_ones_without_the_tenant() -> None:
    published = {**GPU.attributes, "tenant": {"string": "team-a"}, "type": {"string": "gpu"}}
    attrs = device_attributes(published)
    assert "tenant" not in attrs
    assert attrs["type"] == {"string": "gpu"} and list(attrs) == sorted(attrs)


def test_an_on_demand_mig_device_gets_the_uuid_prepare_learnt() -> None:
    published = {"type": {"string": "mig"}, "parentUUID": {"string": "GPU-1"}}
    attrs = device_attributes(published, uuid="MIG-2")
    assert attrs["uuid"] == {"string": "MIG-2"} and attrs["parentUUID"] == {"string": "GPU-1"}


def test_a_share_carries_its_id_and_what_it_was_granted_as_integers() -> None:
    consumed = {
        "memory": parse_quantity("16Gi"),
        "compute": parse_quantity("30"),
        "multiprocessors": parse_quantity("0"),  # selected on, never granted
    }
    attrs = device_attributes({"type": {"string": "shared"}}, share_id="s-1", consumed=consumed)
    assert attrs["shareID"] == {"string": "s-1"}
    assert attrs["consumedMemory"] == {"int": 16 * 1024**3}
    assert attrs["consumedCompute"] == {"int": 30}
    assert "consumedMultiprocessors" not in attrs


def test_never_more_than_32_attributes_the_published_ones_kept() -> None:
    published = {f"attr{i:02d}": {"int": i} for i in range(31)}
    consumed = {"memory": parse_quantity("1Gi"), "compute": parse_quantity("5")}
    attrs = device_attributes(published, share_id="s", consumed=consumed)
    assert len(attrs) == MAX_ATTRIBUTES
    assert set(published) <= set(attrs)


def test_the_claims_spec_mounts_each_requests_file_read_only_in_a_device_of_its_own() -> None:
    identity = ClaimIdentity(CLAIM.uid, CLAIM.namespace, CLAIM.name)
    mounts = [
        MetadataMount(
            "a", "/data/dra-device-metadata/u/a/metadata.json", container_path(CLAIM, "a")
        ),
        MetadataMount(
            "b", "/data/dra-device-metadata/u/b/metadata.json", container_path(CLAIM, "b")
        ),
    ]
    spec = render_claim_spec(identity, [CdiDevice("gpu-0", "GPU-1")], metadata=mounts)
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    for mount in mounts:
        edits = by_name[f"{CLAIM.uid}_metadata_{mount.request}"]
        assert edits == {
            "mounts": [
                {
                    "hostPath": mount.host_path,
                    "containerPath": mount.container_path,
                    "options": list(METADATA_MOUNT_OPTIONS),
                }
            ]
        }
    assert "ro" in METADATA_MOUNT_OPTIONS and "rw" not in METADATA_MOUNT_OPTIONS
    assert metadata_requests(spec, CLAIM.uid) == ["a", "b"]
    assert metadata_device_id(CLAIM.uid, "a") == f"gpu.flexgpu.dev/claim={CLAIM.uid}_metadata_a"
    # Untyped bind mounts need no newer spec version than the devices do.
    assert spec["cdiVersion"] == minimum_cdi_version({**spec, "devices": spec["devices"][:1]})


# -- held to upstream's definitions ------------------------------------------------------


@pytest.fixture(scope="module")
def upstream() -> Path:
    root = module_dir(DRA_MODULE)
    if not (root / "api" / "metadata" / "v1beta1" / "types.go").is_file():
        message = (
            f"the device metadata API of {DRA_MODULE} is not under {root}; "
            "run tools/k8s/build.sh to download the Go modules"
        )
        if os.environ.get(SKIP_ENV) == "1":
            pytest.skip(f"{message} ({SKIP_ENV}=1)")
        pytest.fail(message)
    return root


def _go_structs(path: Path) -> dict[str, list[str]]:
    """Each struct of a Go file and its fields' JSON names, in order (embedded TypeMeta: kind,
    apiVersion, as its own type names them)."""
    structs: dict[str, list[str]] = {}
    for name, body in re.findall(r"^type (\w+) struct \{\n(.*?)^\}", path.read_text(), re.M | re.S):
        fields: list[str] = []
        for raw in body.splitlines():
            line = raw.strip()
            if line.startswith("metav1.TypeMeta"):
                fields += ["kind", "apiVersion"]
                continue
            tag = re.search(r'json:"([^",]*)', line)
            if tag and not line.startswith("//"):
                fields.append(tag.group(1))
        structs[name] = fields
    return structs


def _go_const(text: str, name: str) -> str:
    match = re.search(rf'^\s*(?:const\s+)?{name}\s*=\s*"([^"]*)"', text, re.M)
    assert match, f"{name} not found"
    return match.group(1)


def _same_layout(mine: Any, reference: Any, where: str = "") -> None:
    """Every object of ``mine`` has its keys in the order of the object at the same place in
    ``reference``, less those it leaves out; attribute maps are data, not layout."""
    if isinstance(mine, dict):
        assert isinstance(reference, dict), where
        if where.endswith(".attributes"):
            (sample,) = reference.values()
            for name, value in mine.items():
                assert set(value) <= set(sample), f"{where}.{name}"
            return
        assert list(mine) == [k for k in reference if k in mine], where
        for key, value in mine.items():
            _same_layout(value, reference[key], f"{where}.{key}")
    elif isinstance(mine, list):
        assert isinstance(reference, list) and reference, where
        for item in mine:
            _same_layout(item, reference[0], f"{where}[]")


def test_names_and_versions_are_upstreams(upstream: Path) -> None:
    api = upstream / "api" / "metadata"
    types = (api / "types.go").read_text()
    assert _go_const(types, "ContainerDir") == CONTAINER_DIR
    assert _go_const(types, "ResourceClaimsSubDir") == CLAIMS_SUBDIR
    assert _go_const(types, "ResourceClaimTemplatesSubDir") == TEMPLATES_SUBDIR
    assert _go_const(types, "MetadataFileSuffix") == FILE_SUFFIX
    assert _go_const((api / "register.go").read_text(), "GroupName") == GROUP
    for version in VERSIONS:
        register = (api / version / "register.go").read_text()
        assert f'Version: "{version}"' in register
        assert "&DeviceMetadata{}" in register
    assert KIND == "DeviceMetadata"
    # The helper refuses a version list without v1beta1, the newest.
    plugin = (upstream / "kubeletplugin" / "draplugin.go").read_text()
    assert "the latest metadata version is %s (= metadatav1beta1.SchemeGroupVersion)" in plugin
    resource_types = module_dir("k8s.io/api") / "resource" / "v1" / "types.go"
    assert (
        f'PodResourceClaimAnnotation = "{POD_CLAIM_NAME_ANNOTATION}"' in resource_types.read_text()
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_every_field_written_is_a_field_of_the_version(upstream: Path, version: str) -> None:
    structs = _go_structs(upstream / "api" / "metadata" / version / "types.go")
    attribute = _go_structs(module_dir("k8s.io/api") / "resource" / "v1" / "types.go")
    data = encode_metadata(render_metadata(FROM_TEMPLATE, "gpu", [GPU]), (version,))
    (obj,) = _objects(data)
    assert obj["apiVersion"] == f"{GROUP}/{version}"
    assert list(obj) == [k for k in structs["DeviceMetadata"] if k in obj]
    assert list(obj["metadata"]) == ["name", "namespace", "uid", "generation"]
    (request,) = obj["requests"]
    assert list(request) == [k for k in structs["DeviceMetadataRequest"] if k in request]
    (device,) = request["devices"]
    assert list(device) == [k for k in structs["Device"] if k in device]
    for name, value in device["attributes"].items():
        assert len(value) == 1 and set(value) <= set(attribute["DeviceAttribute"]), name


def test_the_layout_matches_upstreams_compatibility_fixture(upstream: Path) -> None:
    """The helper's fixture (every field set) lists its objects and their keys in the order
    its writer emits them; ours are the same, less the fields flexgpu leaves empty."""
    fixture = (upstream / "api" / "metadata" / "testdata" / "HEAD" / "metadata.json").read_bytes()
    theirs = _objects(fixture)
    ours = _objects(encode_metadata(render_metadata(FROM_TEMPLATE, "gpu", [GPU])))
    assert [o["apiVersion"] for o in ours] == [o["apiVersion"] for o in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        _same_layout(mine, reference)
    # Both end each object with a newline after its closing brace.
    assert fixture.count(b"\n}\n") == len(theirs)
