"""Exact parsing of Kubernetes quantities (``10Gi``, ``1.5G``, ``500m``, ``1e3``).

Why not ``kubernetes.utils.quantity.parse_quantity``: it hands the number to ``Decimal(...)``,
so it also accepts text the API server rejects (``1_000``, ``NaN``, ``Infinity``, ``" 5 "``,
non-ASCII digits, an exponent *and* a suffix as in ``1e3Mi``) and it multiplies under the default
28-digit ``Decimal`` context, so large values are silently rounded. A limit a webhook accepts
must be the limit prepare enforces, so this module follows apimachinery's grammar exactly and
computes with ``Fraction`` (no rounding at all):

    <quantity>        ::= <signedNumber><suffix>
    <signedNumber>    ::= [+|-] ( <digits> | <digits>. | <digits>.<digits> | .<digits> )
    <suffix>          ::= <binarySI> | <decimalSI> | <decimalExponent>
    <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
    <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
    <decimalExponent> ::= (e | E) [+|-] <digits>

Digits are ASCII only. Beyond apimachinery, text longer than ``MAX_QUANTITY_LENGTH`` and
exponents beyond ``MAX_DECIMAL_EXPONENT`` are rejected: no real quantity needs them, and they
would let a 10 KiB config make us build astronomically large numbers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Final

MAX_QUANTITY_LENGTH: Final = 64
MAX_DECIMAL_EXPONENT: Final = 100
INT64_MAX: Final = 2**63 - 1

_BINARY_SUFFIXES: Final[dict[str, int]] = {
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_DECIMAL_SUFFIXES: Final[dict[str, Fraction]] = {
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "": Fraction(1),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
}

# [0-9], not \d: \d matches any Unicode digit, which the API server does not accept.
_NUMBER = re.compile(r"([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)")
_EXPONENT = re.compile(r"[eE]([+-]?[0-9]+)")


class QuantityError(ValueError):
    """``text`` is not a Kubernetes quantity; ``reason`` says what is wrong, briefly."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"{text!r} is not a Kubernetes quantity: {reason}")
        self.text = text
        self.reason = reason


@dataclass(frozen=True)
class Quantity:
    """A parsed quantity: ``text`` as written, ``value`` exactly (``"1.5Ki"`` -> 1536)."""

    text: str
    value: Fraction

    def is_integer(self) -> bool:
        return self.value.denominator == 1

    def to_int(self) -> int:
        """The exact integer value; a fractional quantity raises ``ValueError``."""
        if not self.is_integer():
            raise ValueError(f"quantity {self.text!r} is not a whole number")
        return self.value.numerator

    def ceil(self) -> int:
        """Rounded up, as apimachinery's ``Quantity.Value()`` does (``"100m"`` -> 1)."""
        return -(-self.value.numerator // self.value.denominator)


def parse_quantity(text: str) -> Quantity:
    """Parse ``text`` exactly; raise ``QuantityError`` naming what is malformed."""
    if not isinstance(text, str):
        raise QuantityError(repr(text), "not a string")
    if not text:
        raise QuantityError(text, "empty")
    if len(text) > MAX_QUANTITY_LENGTH:
        raise QuantityError(text[:MAX_QUANTITY_LENGTH] + "...", "longer than 64 characters")
    number = _NUMBER.match(text)
    if number is None:
        raise QuantityError(text, "does not start with a number")
    sign, digits = number.groups()
    suffix = text[number.end() :]
    whole, _, fraction = digits.partition(".")
    # int() of at most 64 ASCII digits: well under Python's int-from-string digit limit.
    value = Fraction(int(whole or "0") * 10 ** len(fraction) + int(fraction or "0"))
    value /= 10 ** len(fraction)
    if sign == "-":
        value = -value
    if suffix in _BINARY_SUFFIXES:
        return Quantity(text, value * _BINARY_SUFFIXES[suffix])
    if suffix in _DECIMAL_SUFFIXES:
        return Quantity(text, value * _DECIMAL_SUFFIXES[suffix])
    exponent = _EXPONENT.fullmatch(suffix)
    if exponent is None:
        raise QuantityError(text, f'unknown suffix "{suffix}"')
    power = int(exponent.group(1))
    if abs(power) > MAX_DECIMAL_EXPONENT:
        raise QuantityError(text, f"exponent {power} is out of range")
    return Quantity(text, value * Fraction(10) ** power)
