"""The Python packages flexgpu runs with, copied from this interpreter's environment into an
image folder: the same versions the tests run, no index needed."""

from __future__ import annotations

import importlib.metadata as md
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement

PROJECT = "flexgpu"
# Our own packages: they come from the source tree (the project is installed editable), and are
# installed under the flexgpu namespace as the wheel installs them.
NAMESPACE = "flexgpu"
OWN_PACKAGES = ("driver", "kubelet_plugin", "controller")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dependency_closure(project: str = PROJECT, machine: str = "") -> list[md.Distribution]:
    """Every installed distribution ``project`` needs at run time (no extras), sorted;
    markers read for ``machine`` (a wheel's machine name such as aarch64) when given."""
    environment = {"extra": ""} | ({"platform_machine": machine} if machine else {})
    seen: dict[str, md.Distribution] = {}
    todo = [project]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as err:
            # Only a marker of another machine can ask for one the environment lacks.
            raise md.PackageNotFoundError(
                f"{name}: a run-time dependency (for {machine or 'this machine'}) that this "
                "environment does not hold; install it so its version is decided here"
            ) from err
        seen[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate(environment):
                continue
            todo.append(req.name)
    return [seen[n] for n in sorted(seen) if n != _norm(project)]


def _site_files(dist: md.Distribution) -> Iterable[tuple[Path, Path]]:
    """(source file, path relative to site-packages) for files inside site-packages."""
    for entry in dist.files or []:
        rel = Path(str(entry))
        if rel.parts and rel.parts[0] == "..":
            continue  # console scripts and data outside site-packages
        if "__pycache__" in rel.parts:
            continue
        src = Path(str(dist.locate_file(entry)))
        if src.is_file():
            yield src, rel


def copy_dependencies(dest: Path) -> list[str]:
    """Copies the run-time dependencies into ``dest`` (a site-packages folder); returns
    their ``name==version`` list."""
    copied: list[str] = []
    for dist in dependency_closure():
        for src, rel in _site_files(dist):
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
        copied.append(f"{dist.metadata['Name']}=={dist.version}")
    records_inside(dest)
    return copied


def records_inside(site: Path) -> None:
    """Each distribution's RECORD in ``site`` lists only files inside it. The lines for
    files outside (``../``: console scripts, whose shebang names the interpreter of the
    environment that installed them, so their hashes differ with its path) describe files
    the image does not ship, and would make its digest depend on where it was built."""
    for record in sorted(site.glob("*.dist-info/RECORD")):
        lines = record.read_text().splitlines(keepends=True)
        kept = [line for line in lines if not line.startswith("../")]
        if kept != lines:
            record.write_text("".join(kept))


def copy_project(repo: Path, dest: Path) -> None:
    """Copies flexgpu's own packages (sources and data files) into ``dest``/flexgpu."""
    (dest / NAMESPACE).mkdir(parents=True, exist_ok=True)
    shutil.copy2(repo / NAMESPACE / "__init__.py", dest / NAMESPACE / "__init__.py")
    for pkg in OWN_PACKAGES:
        shutil.copytree(
            repo / pkg,
            dest / NAMESPACE / pkg,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )


def console_scripts(project: str = PROJECT) -> dict[str, str]:
    """Script name -> ``module:function`` from the project's entry points."""
    dist = md.distribution(project)
    return {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}


def dependency_key() -> str:
    """What decides the dependency layer's content: each distribution and its version."""
    return "\n".join(f"{d.metadata['Name']}=={d.version}" for d in dependency_closure())
