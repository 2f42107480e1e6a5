"""The docs name only what exists: the kubelet plugin's flags, the CLI's subcommands, the
chart's values and the files and headings they link to; and every flag and subcommand is
documented where an admin looks for it. Each test fails the day a doc and the code part."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flexgpu.controller.cli import build_parser
from flexgpu.kubelet_plugin.config_flags import SETTINGS

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
PLUGIN_DOC = REPO / "docs" / "kubelet-plugin.md"
CLI_DOC = REPO / "docs" / "cli.md"
CHART = REPO / "charts" / "flexgpu"

# Flags of other programs that docs/kubelet-plugin.md names beside the plugin's (its
# measurements), with the file that defines each: checked there instead.
OTHER_PROGRAMS_FLAGS = {
    "--source": REPO / "tools" / "plugin_startup.py",
    "--example-on-host": REPO / "bench" / "pod_start.py",
}

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _prose(text: str) -> str:
    """The text without fenced code blocks."""
    return _FENCE.sub("", text)


def _spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    return _SPAN.findall(_prose(text))


def _code_lines(text: str) -> Iterator[str]:
    """The lines of fenced code blocks, without a leading shell prompt."""
    for block in _FENCE.findall(text):
        for line in block.splitlines():
            yield line.strip().removeprefix("$ ")


# --------------------------------------------------------------------------- plugin flags


def _plugin_settings_table() -> set[tuple[str, str]]:
    text = PLUGIN_DOC.read_text()
    return set(re.findall(r"^\| `(--[a-z0-9-]+)` \| `([A-Z0-9_]+)` \|", text, re.M))


def test_the_plugin_settings_table_lists_exactly_the_plugins_flags() -> None:
    """docs/kubelet-plugin.md's table has one row per flag of config_flags.SETTINGS, with
    that flag's environment variable, and no row for a flag the plugin does not have."""
    documented = _plugin_settings_table()
    actual = {(s.flag, s.env) for s in SETTINGS}
    assert not actual - documented, f"flags missing from the table: {sorted(actual - documented)}"
    assert not documented - actual, f"rows for no such flag: {sorted(documented - actual)}"


def test_every_flag_docs_kubelet_plugin_names_exists() -> None:
    """Each ``--flag`` the page names in a code span that starts with a flag (``--x``,
    ``--x=v``, ``--x=1 --y=2``) is one of the plugin's, or one of the few other programs'
    flags its measurements name, which must then exist in that program."""
    plugin_flags = {s.flag for s in SETTINGS}
    unknown = []
    for span in _spans(PLUGIN_DOC.read_text()):
        if not span.startswith("--"):
            continue
        for flag in re.findall(r"(?:^|\s)(--[a-z0-9][a-z0-9-]*)", span):
            if flag in plugin_flags:
                continue
            program = OTHER_PROGRAMS_FLAGS.get(flag)
            if program is None or f'"{flag}"' not in program.read_text():
                unknown.append(flag)
    assert not unknown, f"docs/kubelet-plugin.md names flags nothing defines: {unknown}"


# --------------------------------------------------------------------------- CLI


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


_COMMAND = re.compile(r"(?:^|kubectl\s+|[|;&(]\s*)flexgpu\s+([a-z][a-z0-9-]*)(?:\s+(\S+))?")


def _commands_named(text: str) -> set[tuple[str, str]]:
    """(subcommand, next word) for every ``flexgpu <subcommand>`` (or ``kubectl flexgpu``) in
    a code span that starts with the command, or on a line of a code block."""
    lines = [s.strip() for s in _spans(text) if re.match(r"(kubectl\s+)?flexgpu\s", s.strip())]
    lines += list(_code_lines(text))
    return {(m[1], m[2] or "") for line in lines for m in _COMMAND.finditer(line)}


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_flexgpu_subcommand_the_docs_name_exists(page: Path) -> None:
    """``flexgpu <subcommand>`` in a page's code is a subcommand of the CLI's parser, and
    ``flexgpu doctor <scope>`` one of that subcommand's own (a bare word after a subcommand
    that has none is an argument, such as ``explain`` 's NAME)."""
    commands = _subparsers(build_parser())
    wrong = []
    for name, after in sorted(_commands_named(page.read_text())):
        if name not in commands:
            wrong.append(name)
            continue
        nested = _subparsers(commands[name])
        if nested and re.fullmatch(r"[a-z][a-z-]*", after) and after not in nested:
            wrong.append(f"{name} {after}")
    assert not wrong, f"{_rel(page)} names no such command: {wrong}"


def test_docs_cli_has_a_row_for_every_subcommand() -> None:
    """docs/cli.md's command table has a row for each subcommand ``flexgpu --help`` lists,
    and none for a command that does not exist."""
    rows = re.findall(r"^\| `([a-z][a-z-]*)[^`]*` \|", CLI_DOC.read_text(), re.M)
    commands = set(_subparsers(build_parser()))
    assert set(rows) == commands, (
        f"missing: {sorted(commands - set(rows))}, no such command: {sorted(set(rows) - commands)}"
    )


# --------------------------------------------------------------------------- chart values


def _values() -> dict[str, Any]:
    loaded = yaml.safe_load((CHART / "values.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def _value_exists(path: str, values: dict[str, Any]) -> bool:
    """Whether ``a.b.c`` is a value: every part a key of values.yaml, except below an empty
    map or a list (free-form: ``issuerRef``, ``tolerations``), or ``global.*``, which a parent
    chart sets and the templates read."""
    parts = re.sub(r"\[[^]]*\]", "", path).split(".")
    if parts[0] == "global":
        templates = "".join(p.read_text() for p in (CHART / "templates").glob("*"))
        return f"(.Values.global).{'.'.join(parts[1:])}" in templates
    node: Any = values
    for part in parts:
        if isinstance(node, list) or node == {}:
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _is_code_path(token: str) -> bool:
    """A file name or a Python module path (``controller.evaluation.Memo``), not a value."""
    if re.search(r"\.(py|md|ya?ml|json|go|sh|txt|tpl)$", token):
        return True
    parts = token.split(".")
    return any(
        (REPO.joinpath(*parts[:n]).with_suffix(".py")).is_file()
        or (REPO.joinpath(*parts[:n]) / "__init__.py").is_file()
        for n in range(2, len(parts) + 1)
    )


def _value_paths(text: str, tops: set[str]) -> Iterator[str]:
    """Dotted chart value paths in code spans and code blocks (``a.b``, ``--set a.b=v``,
    ``a.b: v``, ``a.b.*``), leaving out the first column of tables of NVIDIA's values."""
    header_is_nvidia = False
    previous = ""
    kept = []
    for raw in _prose(text).splitlines():
        cells = raw.split("|")[1:]
        if raw.startswith("|") and not previous.startswith("|"):
            header_is_nvidia = "NVIDIA" in cells[0]
        nvidia_row = raw.startswith("|") and header_is_nvidia
        kept.append("|".join(cells[1:]) if nvidia_row else raw)
        previous = raw
    sources = ["\n".join(_SPAN.findall(line)) for line in kept]
    sources += list(_code_lines(text))
    for source in sources:
        for token in re.split(r"[\s,()]+", source):
            path = re.split(r"[=:]", token, maxsplit=1)[0].removesuffix(".*")
            if "." in path and path.split(".")[0] in tops and not _is_code_path(path):
                yield path


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_chart_value_the_docs_name_exists(page: Path) -> None:
    """Each chart value path a page names in code (``kubeletPlugin.healthPort``,
    ``--set deviceClasses.migExtendedResources.enabled=true``) is in charts/flexgpu/values.yaml,
    so an admin who sets it changes something (the schema would refuse it anyway, at
    install)."""
    values = _values()
    tops = set(values) | {"global"}
    missing = sorted(
        {p for p in _value_paths(page.read_text(), tops) if not _value_exists(p, values)}
    )
    assert not missing, f"{_rel(page)} names chart values values.yaml lacks: {missing}"


# --------------------------------------------------------------------------- links


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores
    dropped, spaces made hyphens."""
    text = re.sub(r"[`*]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", _prose(page.read_text()), re.M):
        slug = _slug(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_reaches_a_file_and_heading(page: Path) -> None:
    """Each relative markdown link of the page points at a file or folder of the repository
    and, with ``#anchor``, at a heading of that page."""
    broken = []
    for target in _LINK.findall(_SPAN.sub("", _prose(page.read_text()))):
        if re.match(r"[a-z][a-z+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{_rel(page)} links to nothing: {broken}"
