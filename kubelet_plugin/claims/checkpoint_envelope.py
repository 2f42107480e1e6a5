"""The sealed envelope every checkpoint file is: ``{"checksum": "sha256:<hex>", "data": ...}``,
the checksum over the canonical JSON of "data" (sorted keys, no whitespace)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

_CHECKSUM_PREFIX: Final = "sha256:"


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def checksum(data: Any) -> str:
    return _CHECKSUM_PREFIX + hashlib.sha256(canonical_json(data)).hexdigest()


def seal(data: dict[str, Any]) -> bytes:
    """The on-disk envelope of ``data``: the canonical JSON of {"checksum", "data"}, built
    around the one encoding of ``data`` that the checksum needs (keys sorted: "checksum"
    comes first)."""
    body = canonical_json(data)
    digest = _CHECKSUM_PREFIX + hashlib.sha256(body).hexdigest()
    return b'{"checksum":' + json.dumps(digest).encode() + b',"data":' + body + b"}"


class Unusable(Exception):
    """A file that cannot be used: corrupt (version None) or of a newer version."""

    def __init__(self, reason: str, version: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.version = version


def open_envelope(raw: bytes, newest: int) -> dict[str, Any]:
    """The checked "data" of a file. The version is looked at before the checksum: a newer
    plugin may seal its files differently, and such a file is foreign, not corrupt."""
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Unusable(f"not JSON: {exc}") from exc
    if not isinstance(document, dict) or not isinstance(document.get("data"), dict):
        raise Unusable("no 'data' object")
    data: dict[str, Any] = document["data"]
    version = data.get("version")
    if isinstance(version, int) and not isinstance(version, bool) and version > newest:
        raise Unusable(f"schema version {version}", version)
    if document.get("checksum") != checksum(data):
        raise Unusable("checksum mismatch")
    return data
