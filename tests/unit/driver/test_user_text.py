"""Echoed user input stays short and says how long it was."""

from __future__ import annotations

from flexgpu.driver.user_text import ECHO_LIMIT, shorten


def test_short_text_is_kept_as_is() -> None:
    assert shorten("claim-a") == "claim-a"
    assert shorten("x" * ECHO_LIMIT) == "x" * ECHO_LIMIT


def test_long_text_is_cut_with_an_ellipsis_and_the_original_length() -> None:
    text = "y" * 1_048_576
    assert shorten(text) == "y" * ECHO_LIMIT + "... (1048576 characters)"
    assert shorten("abcdef", limit=3) == "abc... (6 characters)"


def test_unencodable_characters_are_escaped() -> None:
    shown = shorten("a\ud800b")
    shown.encode("utf-8")  # would raise for a lone surrogate
    assert shown == "a\\ud800b"
