"""Kubernetes quantity parsing: apimachinery's grammar, exact values, clear rejections."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubernetes.utils.quantity import parse_quantity as client_parse_quantity

from flexgpu.driver.quantity import Quantity, QuantityError, parse_quantity

GOOD = [
    ("0", Fraction(0)),
    ("1", Fraction(1)),
    ("+5", Fraction(5)),
    ("-5", Fraction(-5)),
    ("007", Fraction(7)),
    ("1.", Fraction(1)),
    (".5", Fraction(1, 2)),
    ("1.5Gi", Fraction(3 * 2**29)),
    ("10Gi", Fraction(10 * 2**30)),
    ("512Mi", Fraction(512 * 2**20)),
    ("1Ki", Fraction(1024)),
    ("1Ti", Fraction(2**40)),
    ("1Pi", Fraction(2**50)),
    ("2Ei", Fraction(2**61)),
    ("100m", Fraction(1, 10)),
    ("1n", Fraction(1, 10**9)),
    ("1u", Fraction(1, 10**6)),
    ("1k", Fraction(1000)),
    ("1M", Fraction(10**6)),
    ("1.5G", Fraction(15 * 10**8)),
    ("1T", Fraction(10**12)),
    ("1P", Fraction(10**15)),
    ("1E", Fraction(10**18)),  # a bare E is the exa suffix, not an exponent
    ("1e3", Fraction(1000)),
    ("1E3", Fraction(1000)),
    ("1e+3", Fraction(1000)),
    ("15e-1", Fraction(3, 2)),
    ("-1.5e2", Fraction(-150)),
    ("1.G", Fraction(10**9)),  # apimachinery accepts a trailing dot before a suffix
    # Beyond Decimal's default 28 digits: still exact.
    ("123456789012345678901234567890Ei", Fraction(123456789012345678901234567890 * 2**60)),
]


@pytest.mark.parametrize(("text", "value"), GOOD)
def test_parses_exactly(text: str, value: Fraction) -> None:
    assert parse_quantity(text) == Quantity(text, value)


BAD = [
    ("", "empty"),
    ("Gi", "does not start with a number"),
    (".", "does not start with a number"),
    (" 5", "does not start with a number"),
    ("NaN", "does not start with a number"),
    ("Infinity", "does not start with a number"),
    ("\u0661\u0662", "does not start with a number"),  # Arabic-Indic digits
    ("5 ", 'unknown suffix " "'),
    ("1_000", 'unknown suffix "_000"'),
    ("10GB", 'unknown suffix "GB"'),
    ("1ki", 'unknown suffix "ki"'),
    ("1mi", 'unknown suffix "mi"'),
    ("1K", 'unknown suffix "K"'),
    ("1e3Mi", 'unknown suffix "e3Mi"'),
    ("1e", 'unknown suffix "e"'),
    ("1e1.5", 'unknown suffix "e1.5"'),
    ("1Gi\n", 'unknown suffix "Gi\n"'),
    ("--1", "does not start with a number"),
    ("1e101", "exponent 101 is out of range"),
    ("1e-101", "exponent -101 is out of range"),
    ("1" * 65, "longer than 64 characters"),
]


@pytest.mark.parametrize(("text", "reason"), BAD)
def test_rejects_with_reason(text: str, reason: str) -> None:
    with pytest.raises(QuantityError) as caught:
        parse_quantity(text)
    assert caught.value.reason == reason


def test_error_names_the_text() -> None:
    with pytest.raises(QuantityError, match=r"^'10GB' is not a Kubernetes quantity: unknown"):
        parse_quantity("10GB")


def test_non_string_is_rejected() -> None:
    with pytest.raises(QuantityError) as caught:
        parse_quantity(5)  # type: ignore[arg-type]
    assert caught.value.reason == "not a string"


def test_integer_helpers() -> None:
    assert parse_quantity("1.5Ki").to_int() == 1536
    assert parse_quantity("100m").ceil() == 1
    assert parse_quantity("-100m").ceil() == 0
    assert parse_quantity("2").ceil() == 2
    with pytest.raises(ValueError, match="not a whole number"):
        parse_quantity("100m").to_int()


def test_the_client_parser_is_not_exact_nor_strict() -> None:
    """Why driver.quantity exists: the kubernetes client's parser rounds and is lax."""
    big = "123456789012345678901234567890Ei"
    assert Fraction(client_parse_quantity(big)) != parse_quantity(big).value
    assert client_parse_quantity("1_000") == Decimal(1000)
    with pytest.raises(QuantityError):
        parse_quantity("1_000")


@pytest.mark.parametrize("text", ["10Gi", "1.5G", "100m", "1e3", "-2Ki", ".5M", "7"])
def test_agrees_with_the_client_parser_on_ordinary_input(text: str) -> None:
    assert Fraction(client_parse_quantity(text)) == parse_quantity(text).value


SUFFIXES = {
    "": 1,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-(10**30), max_value=10**30), st.sampled_from(sorted(SUFFIXES)))
def test_integer_with_suffix(number: int, suffix: str) -> None:
    assert parse_quantity(f"{number}{suffix}").value == number * SUFFIXES[suffix]


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=10**20), st.integers(min_value=0, max_value=12))
def test_decimal_fraction_is_exact(digits: int, scale: int) -> None:
    text = str(digits).rjust(scale + 1, "0")
    written = f"{text[: len(text) - scale]}.{text[len(text) - scale :]}"
    assert parse_quantity(written).value == Fraction(digits, 10**scale)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from("0123456789.+-eEKkMmGiTPnu \u0661_"), max_size=20))
def test_never_raises_anything_else(text: str) -> None:
    try:
        quantity = parse_quantity(text)
    except QuantityError as error:
        assert error.reason
    else:
        assert quantity.text == text
