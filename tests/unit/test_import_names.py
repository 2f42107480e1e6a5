"""Module names the code may use.

The packages are installed as ``flexgpu.driver``, ``flexgpu.kubelet_plugin`` and
``flexgpu.controller`` (the folder ``flexgpu/`` links to the top-level folders). A bare
``import driver`` would still work from a checkout and load every module a second time under
another name, with its own globals and locks, and fail once installed; so no code may use it.
kopf's underscore modules may change in any 1.x release; the controller uses its public API.
import-linter cannot say either (it sees ``kopf`` as one external package, and ``driver`` is not
one of its root packages), hence these checks over the source.
"""

from __future__ import annotations

import ast
import subprocess
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BARE_NAMES = {"driver", "kubelet_plugin", "controller"}


def _python_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    return [REPO / name for name in listed if (REPO / name).is_file()]


def _imported_modules(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module
            # `from kopf import _core` names a private module too.
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def test_no_code_imports_the_packages_by_their_bare_folder_names() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in _python_files()
        for line, module in _imported_modules(path)
        if module.split(".")[0] in BARE_NAMES
    ]
    assert not bad, "import these as flexgpu.<package>:\n" + "\n".join(bad)


def test_no_code_imports_kopfs_private_modules() -> None:
    bad = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in _python_files()
        for line, module in _imported_modules(path)
        if module.split(".")[0] == "kopf" and any(p.startswith("_") for p in module.split(".")[1:])
    ]
    assert not bad, "kopf's private modules:\n" + "\n".join(bad)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    # The checks above would pass vacuously if the parser missed these forms.
    sample = tmp_path / "sample.py"
    sample.write_text("import driver.cdi\nfrom controller import main\nfrom kopf import _core\n")
    found = [module for _, module in _imported_modules(sample)]
    assert "driver.cdi" in found
    assert "controller" in found
    assert "kopf._core" in found
