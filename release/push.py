"""Pushes an OCI archive (release/image.py or tools/images wrote it: one image, or an image
index over one image per platform) to a registry over the OCI distribution API, unchanged:
the blobs, manifest and index bytes go up as they are, so the digest in the registry is the
digest the archive holds. No container engine needed.

    python -m release.push <archive.tar> <registry>/<repository>:<tag> [--plain-http]

Prints ``<registry>/<repository>@<digest>``. Credentials, where the registry asks for them,
come from FLEXGPU_REGISTRY_USER and FLEXGPU_REGISTRY_PASSWORD (basic or bearer-token
challenge, as the distribution spec's registries answer)."""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import IO, Any

from release.oci import INDEX_MEDIA_TYPE, MANIFEST_MEDIA_TYPE

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


class PushError(RuntimeError):
    pass


@dataclass(frozen=True)
class Reference:
    registry: str
    repository: str
    tag: str

    @classmethod
    def parse(cls, text: str) -> Reference:
        registry, sep, rest = text.partition("/")
        name, colon, tag = rest.rpartition(":")
        if not sep or not colon or not name or not tag or "/" in tag or "@" in text:
            raise PushError(
                f"image reference {text!r}: expected <registry>/<repository>:<tag> "
                "(a registry host, a repository path and a tag; no digest)"
            )
        return cls(registry, name, tag)


def manifest_digest(archive: str) -> str:
    """The digest of what an OCI archive names: its image manifest, or its image index."""
    with tarfile.open(archive) as tar:
        _, data = _manifest(tar)
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _label(tar: tarfile.TarFile) -> str:
    return os.fsdecode(tar.name or "")


def _read(tar: tarfile.TarFile, name: str) -> bytes:
    f = tar.extractfile(name)
    if f is None:
        raise PushError(f"{_label(tar)}: no file {name} in the OCI archive")
    return f.read()


def _blob_name(digest: str) -> str:
    algo, _, hexpart = digest.partition(":")
    return f"blobs/{algo}/{hexpart}"


def _manifest(tar: tarfile.TarFile) -> tuple[dict[str, Any], bytes]:
    """What index.json names (one image manifest or one image index), parsed and as bytes."""
    index = json.loads(_read(tar, "index.json"))
    manifests = index.get("manifests") or []
    kinds = (MANIFEST_MEDIA_TYPE, INDEX_MEDIA_TYPE)
    if len(manifests) != 1 or manifests[0].get("mediaType") not in kinds:
        raise PushError(
            f"{_label(tar)}: expected one image manifest or image index in index.json, "
            f"found {manifests}"
        )
    data = _read(tar, _blob_name(manifests[0]["digest"]))
    return json.loads(data), data


def _children(tar: tarfile.TarFile, index: dict[str, Any]) -> list[tuple[dict[str, Any], bytes]]:
    """The image manifests an image index lists (each platform's), parsed and as bytes."""
    found = []
    for desc in index.get("manifests") or []:
        if desc.get("mediaType") != MANIFEST_MEDIA_TYPE:
            raise PushError(
                f"{_label(tar)}: the image index lists {desc.get('mediaType')!r}; "
                f"only image manifests ({MANIFEST_MEDIA_TYPE}) are pushed"
            )
        data = _read(tar, _blob_name(desc["digest"]))
        found.append((json.loads(data), data))
    return found


class _Client:
    def __init__(self, ref: Reference, plain_http: bool) -> None:
        self.ref = ref
        self.base = f"{'http' if plain_http else 'https'}://{ref.registry}"
        self.auth: str | None = None
        self.user = os.environ.get("FLEXGPU_REGISTRY_USER", "")
        self.password = os.environ.get("FLEXGPU_REGISTRY_PASSWORD", "")

    def _login(self, challenge: str) -> None:
        scheme, _, params = challenge.partition(" ")
        fields = dict(re.findall(r'(\w+)="([^"]*)"', params))
        basic = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        if scheme.lower() == "basic":
            self.auth = f"Basic {basic}"
            return
        if scheme.lower() != "bearer" or "realm" not in fields:
            raise PushError(f"{self.ref.registry}: unsupported authentication {challenge!r}")
        query = {"service": fields.get("service", ""), "scope": fields.get("scope", "")}
        if not query["scope"]:
            query["scope"] = f"repository:{self.ref.repository}:pull,push"
        req = urllib.request.Request(f"{fields['realm']}?{urllib.parse.urlencode(query)}")
        if self.user:
            req.add_header("Authorization", f"Basic {basic}")
        with urllib.request.urlopen(req, timeout=60) as resp:
            token = json.loads(resp.read())
        self.auth = "Bearer " + (token.get("token") or token.get("access_token") or "")

    def request(
        self,
        method: str,
        url: str,
        body: bytes | IO[bytes] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """One request, logging in once on a 401; returns the response (status < 400)."""
        full = url if url.startswith("http") else self.base + url
        for attempt in (0, 1):
            req = urllib.request.Request(full, data=body, method=method, headers=headers or {})
            if self.auth:
                req.add_header("Authorization", self.auth)
            try:
                return urllib.request.urlopen(req, timeout=600)
            except urllib.error.HTTPError as err:
                challenge = err.headers.get("WWW-Authenticate", "")
                if err.code == 401 and attempt == 0 and challenge and not self.auth:
                    self._login(challenge)
                    if hasattr(body, "seek"):
                        body.seek(0)  # type: ignore[union-attr]
                    continue
                if method == "HEAD" and err.code == 404:
                    return None
                detail = err.read().decode(errors="replace")[:500]
                raise PushError(f"{method} {full}: HTTP {err.code} {detail}") from err
            except urllib.error.URLError as err:
                raise PushError(f"{method} {full}: {err.reason}") from err
        raise PushError(f"{method} {full}: still unauthorized after logging in")

    def push_blob(self, tar: tarfile.TarFile, digest: str, size: int) -> None:
        repo = self.ref.repository
        if self.request("HEAD", f"/v2/{repo}/blobs/{digest}") is not None:
            return
        with self.request("POST", f"/v2/{repo}/blobs/uploads/", b"") as resp:
            location = resp.headers["Location"]
        if location.startswith("/"):
            location = self.base + location
        sep = "&" if "?" in location else "?"
        f = tar.extractfile(_blob_name(digest))
        if f is None:
            raise PushError(f"{_label(tar)}: blob {digest} is missing")
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
        self.request("PUT", url, f, headers).close()


def _put_manifest(cli: _Client, reference: str, data: bytes, media_type: str) -> str:
    """PUTs manifest or index bytes under ``reference`` (a tag or a digest); returns the
    digest the registry says it stored, after checking it is the bytes' own."""
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    headers = {"Content-Type": media_type}
    url = f"/v2/{cli.ref.repository}/manifests/{reference}"
    with cli.request("PUT", url, data, headers) as resp:
        stored = resp.headers.get("Docker-Content-Digest", digest)
    if stored != digest:
        raise PushError(
            f"{cli.ref.registry}/{cli.ref.repository}:{reference}: the registry stored digest "
            f"{stored}, the archive has {digest}"
        )
    return digest


def push(archive: str, reference: str, *, plain_http: bool | None = None) -> str:
    """Pushes the archive's image (or image index, with every platform's image first) as
    ``reference``; returns ``registry/repository@digest`` after checking that the registry
    stored it under the archive's digest."""
    ref = Reference.parse(reference)
    if plain_http is None:
        plain_http = ref.registry.rsplit(":", 1)[0] in LOCAL_HOSTS
    cli = _Client(ref, plain_http)
    with tarfile.open(archive) as tar:
        top, data = _manifest(tar)
        media_type = top.get("mediaType", MANIFEST_MEDIA_TYPE)
        images = _children(tar, top) if media_type == INDEX_MEDIA_TYPE else [(top, data)]
        for manifest, _ in images:
            for desc in [manifest["config"], *manifest["layers"]]:
                cli.push_blob(tar, desc["digest"], int(desc["size"]))
        if media_type == INDEX_MEDIA_TYPE:
            # A registry accepts an index only once the manifests it lists are there.
            for _, child in images:
                child_digest = "sha256:" + hashlib.sha256(child).hexdigest()
                _put_manifest(cli, child_digest, child, MANIFEST_MEDIA_TYPE)
    digest = _put_manifest(cli, ref.tag, data, media_type)
    return f"{ref.registry}/{ref.repository}@{digest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("archive")
    parser.add_argument("reference", help="<registry>/<repository>:<tag>")
    parser.add_argument("--plain-http", action="store_true", default=None)
    args = parser.parse_args(argv)
    try:
        print(push(args.archive, args.reference, plain_http=args.plain_http))
    except (PushError, OSError, tarfile.TarError) as err:
        print(f"error: pushing {args.archive} failed: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
