"""Device metadata for containers (KEP-5304, "DRA Device Attributes Downward API"): what a
container finds about the devices it was given, rendered in the KEP's format. Pure: no file
I/O here (the kubelet plugin writes the files: kubelet_plugin/claims/metadata_files.py).

The format is the one ``k8s.io/dynamic-resource-allocation`` defines (``api/metadata``) and
its kubelet-plugin helper writes, so any consumer of the KEP reads flexgpu's files:

- one file per request of a claim, seen in the container at
  ``/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/
  gpu.flexgpu.dev-metadata.json``, or under ``resourceclaimtemplates/<pod claim name>/`` for
  a claim made from a template (its ``resource.kubernetes.io/pod-claim-name`` annotation);
  the driver's name in the file name keeps drivers serving one request apart;
- the file is a stream of JSON objects, the same content once per API version, newest first
  (``metadata.resource.k8s.io/v1beta1``, then ``v1alpha1`` for readers built against
  Kubernetes 1.36): a reader takes the first object whose ``apiVersion`` it knows;
- each object is a ``DeviceMetadata``: the claim's name, namespace and UID with
  ``generation`` 1 in ``metadata``, ``podClaimName`` for a template's claim, and one entry in
  ``requests`` naming the request as the allocation does (``gpu/h100`` for a
  ``firstAvailable`` subrequest) with its devices: ``driver``, ``pool``, ``name`` and
  ``attributes`` in a ResourceSlice's attribute shape (``{"string": ...}``, ``{"int": ...}``,
  ``{"bool": ...}``, ``{"version": ...}``), unqualified names being the driver's own.

Each device carries the attributes it is published with, so a workload reads what it was
selected by, plus what only prepare knows: the UUID of a MIG device created on demand, and
for a share of a shared GPU its ``shareID`` and what the scheduler granted it
(``consumedMemory`` in bytes, ``consumedCompute`` in percent of the GPU's SMs).
The published ``tenant`` of a shared GPU is left out: it is a scheduling mark (the claim's
own namespace), not a property of the device.

The JSON is laid out as the upstream helper lays it out (its Go encoder: two-space indent,
fields in the types' order, attribute names sorted, ``<``, ``>`` and ``&`` escaped), so a
file reads the same whichever driver wrote it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from flexgpu.driver.names import DRIVER_NAME, TENANT_ATTRIBUTE
from flexgpu.driver.quantity import Quantity

GROUP: Final = "metadata.resource.k8s.io"
KIND: Final = "DeviceMetadata"
# Newest first; v1beta1 (Kubernetes 1.37) must be among them, v1alpha1 (1.36) serves readers
# not yet updated.
VERSIONS: Final = ("v1beta1", "v1alpha1")

# In the container (part of the KEP's API: readers hard-code these).
CONTAINER_DIR: Final = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR: Final = "resourceclaims"
TEMPLATES_SUBDIR: Final = "resourceclaimtemplates"
FILE_SUFFIX: Final = "-metadata.json"
# Set by the control plane on claims made from a ResourceClaimTemplate.
POD_CLAIM_NAME_ANNOTATION: Final = "resource.kubernetes.io/pod-claim-name"

# What a share of a shared GPU is granted, as its file says it (``consumed<Name>``). Its
# ``multiprocessors`` capacity is there to select on and only ever consumed as 0.
SHARE_CAPACITIES: Final = ("memory", "compute")

# resource.k8s.io validation of a metadata device (and of a slice's device).
MAX_ATTRIBUTES: Final = 32

# The Go encoder escapes these inside strings; JSON allows them raw, but a file that reads the
# same whichever driver wrote it is easier to compare and to trust.
_GO_ESCAPES: Final = {
    "<": "\\u003c",
    ">": "\\u003e",
    "&": "\\u0026",
    "\u2028": "\\u2028",
    "\u2029": "\\u2029",
}


@dataclass(frozen=True)
class MetadataDevice:
    """One device of a request as its container reads it."""

    pool: str
    name: str
    attributes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    driver: str = DRIVER_NAME


@dataclass(frozen=True)
class MetadataClaim:
    """The claim a file is about; ``pod_claim_name`` is set for a template's claim."""

    uid: str
    namespace: str
    name: str
    pod_claim_name: str | None = None


def base_request(request: str) -> str:
    """``gpu/h100`` (a subrequest) -> ``gpu``: the request a container names, and the file's
    folder."""
    return request.split("/", 1)[0]


def file_name(driver: str = DRIVER_NAME) -> str:
    return f"{driver}{FILE_SUFFIX}"


def container_path(claim: MetadataClaim, request: str, driver: str = DRIVER_NAME) -> str:
    """Where a container reads the file of one request (its base name) of the claim."""
    if claim.pod_claim_name:
        folder = f"{TEMPLATES_SUBDIR}/{claim.pod_claim_name}"
    else:
        folder = f"{CLAIMS_SUBDIR}/{claim.name}"
    return f"{CONTAINER_DIR}/{folder}/{base_request(request)}/{file_name(driver)}"


def device_attributes(
    published: Mapping[str, Mapping[str, Any]],
    *,
    uuid: str | None = None,
    share_id: str | None = None,
    consumed: Mapping[str, Quantity] | None = None,
) -> dict[str, dict[str, Any]]:
    """A prepared device's attributes: as published (less ``tenant``), its ``uuid`` where
    prepare learnt it (an on-demand MIG device's), and for a share its ``shareID`` and what it
    was granted of ``SHARE_CAPACITIES`` (``consumedMemory`` in bytes, ``consumedCompute`` in
    percent; integers, rounded up). At most 32, the published ones first; names are sorted,
    as the upstream encoder sorts them."""
    attrs = {k: dict(v) for k, v in published.items() if k != TENANT_ATTRIBUTE}
    if uuid:
        attrs["uuid"] = {"string": uuid}
    extra: dict[str, dict[str, Any]] = {}
    if share_id:
        extra["shareID"] = {"string": share_id}
    for name in SHARE_CAPACITIES:
        quantity = (consumed or {}).get(name)
        if quantity is not None:
            extra["consumed" + name[:1].upper() + name[1:]] = {"int": quantity.ceil()}
    for key, value in extra.items():
        if key not in attrs:
            attrs[key] = value
    # A published device holds at most 32 attributes and capacities together, so this only
    # bites if that ever changes: the extras are dropped first.
    kept = sorted(sorted(attrs, key=lambda k: k in extra)[:MAX_ATTRIBUTES])
    return {k: attrs[k] for k in kept}


def render_metadata(
    claim: MetadataClaim,
    request: str,
    devices: Sequence[MetadataDevice],
    generation: int = 1,
) -> dict[str, Any]:
    """One request's ``DeviceMetadata`` without ``kind`` and ``apiVersion`` (the versions
    share every other field); ``request`` as the allocation names it."""
    meta: dict[str, Any] = {
        "name": claim.name,
        "namespace": claim.namespace,
        "uid": claim.uid,
        "generation": generation,
    }
    body: dict[str, Any] = {"metadata": meta}
    if claim.pod_claim_name:
        body["podClaimName"] = claim.pod_claim_name
    entries = []
    for device in devices:
        entry: dict[str, Any] = {"driver": device.driver, "pool": device.pool, "name": device.name}
        if device.attributes:
            entry["attributes"] = {k: dict(device.attributes[k]) for k in sorted(device.attributes)}
        entries.append(entry)
    request_entry: dict[str, Any] = {"name": request}
    if entries:
        request_entry["devices"] = entries
    body["requests"] = [request_entry]
    return body


def encode_metadata(body: Mapping[str, Any], versions: Sequence[str] = VERSIONS) -> bytes:
    """The file: ``body`` once per version, newest first, each object followed by a newline."""
    out = []
    for version in versions:
        document = {"kind": KIND, "apiVersion": f"{GROUP}/{version}", **body}
        text = json.dumps(document, indent=2, ensure_ascii=False)
        for raw, escaped in _GO_ESCAPES.items():
            text = text.replace(raw, escaped)
        out.append(text + "\n")
    return "".join(out).encode()


def decode_metadata(data: bytes) -> list[dict[str, Any]]:
    """Every object of a metadata file, in order (what a reader walks through)."""
    text = data.decode()
    decoder = json.JSONDecoder()
    objects: list[dict[str, Any]] = []
    position = 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return objects
        obj, position = decoder.raw_decode(text, position)
        objects.append(obj)
