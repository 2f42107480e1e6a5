"""JSON decoded as strictly as Kubernetes decodes a driver's opaque configuration: duplicate
keys, NaN and Infinity are errors, and integers too long to be meaningful are not converted."""

from __future__ import annotations

import json
from typing import Any, Final

from flexgpu.driver.validation_messages import BigInt

# JSON integers with more digits are not converted at all (see validation_messages.BigInt).
_MAX_INT_DIGITS: Final = 64


def strict_json_loads(text: str) -> Any:
    """``json.loads`` that raises ``ValueError`` (or ``json.JSONDecodeError``) on a duplicate
    key or a NaN/Infinity constant."""
    return json.loads(text, **_JSON_OPTIONS)


def _object_without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Kubernetes' strict decoding (which NVIDIA's driver uses) rejects duplicate fields too;
    # silently taking the last one hides a typo'd manifest.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {json.dumps(key)}")
        out[key] = value
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _int_or_big(text: str) -> object:
    digits = len(text.lstrip("-"))
    return int(text) if digits <= _MAX_INT_DIGITS else BigInt(digits)


_JSON_OPTIONS: Final[dict[str, Any]] = {
    "object_pairs_hook": _object_without_duplicates,
    "parse_constant": _no_constants,
    "parse_int": _int_or_big,
}
