"""Semantic versions (semver 2.0.0) as Kubernetes' CEL ``semver`` library treats them.

Strict parsing (no leading zeros, exactly three numeric components) is what the library's
``semver("1.2.3")`` does; ``semver(text, true)`` first normalises (drops a leading ``v``, fills
missing components, strips leading zeros). Build metadata does not take part in ordering.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import total_ordering

_STRICT = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
)
_LOOSE_CORE = re.compile(r"v?([0-9]+)(?:\.([0-9]+))?(?:\.([0-9]+))?(.*)")


class SemverError(ValueError):
    pass


@total_ordering
@dataclass(frozen=True)
class Semver:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: tuple[str, ...] = ()

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + ".".join(self.build)
        return text

    def _precedence(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def compare(self, other: Semver) -> int:
        if self._precedence() != other._precedence():
            return -1 if self._precedence() < other._precedence() else 1
        return _compare_prerelease(self.prerelease, other.prerelease)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Semver) and self.compare(other) == 0

    def __hash__(self) -> int:
        return hash((self._precedence(), self.prerelease))

    def __lt__(self, other: Semver) -> bool:
        return self.compare(other) < 0


def _compare_prerelease(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    # A version without a prerelease ranks above the same version with one.
    if not a or not b:
        return (len(b) > 0) - (len(a) > 0)
    for x, y in zip(a, b, strict=False):
        if x == y:
            continue
        x_num, y_num = x.isdigit(), y.isdigit()
        if x_num and y_num:
            return -1 if int(x) < int(y) else 1
        if x_num != y_num:
            return -1 if x_num else 1
        return -1 if x < y else 1
    return (len(a) > len(b)) - (len(a) < len(b))


def parse_semver(text: str) -> Semver:
    match = _STRICT.fullmatch(text)
    if match is None:
        raise SemverError(f"{text!r} is not a semantic version (MAJOR.MINOR.PATCH)")
    pre = tuple(match.group(4).split(".")) if match.group(4) else ()
    for part in pre:
        if part.isdigit() and len(part) > 1 and part.startswith("0"):
            raise SemverError(f"{text!r}: numeric prerelease part {part!r} has a leading zero")
    build = tuple(match.group(5).split(".")) if match.group(5) else ()
    return Semver(int(match.group(1)), int(match.group(2)), int(match.group(3)), pre, build)


def normalize_semver(text: str) -> Semver:
    """``v1.2`` -> 1.2.0, ``01.02.03`` -> 1.2.3; the rest must then be strict semver."""
    match = _LOOSE_CORE.fullmatch(text)
    if match is None:
        raise SemverError(f"{text!r} is not a semantic version")
    parts = [str(int(g)) if g else "0" for g in match.groups()[:3]]
    return parse_semver(".".join(parts) + match.group(4))
