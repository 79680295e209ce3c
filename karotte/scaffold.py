"""`karotte create-env NAME`: a new environment project that passes its tests and
`karotte check` as soon as it is written. The files are in karotte/templates/env/."""
from __future__ import annotations

import importlib.util
import re
import sys
from importlib import resources
from pathlib import Path

_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")


def create_env(name: str, where: Path) -> Path:
    """Write the project NAME under where; returns its directory."""
    if not _NAME.match(name):
        raise ValueError(f"name must be a letter, then up to 63 letters, digits, - or _ "
                         f"(it becomes a Python package name), got {name!r}")
    package = name.replace("-", "_").lower()
    if package in ("karotte", "test", "tests"):
        raise ValueError(f"{name!r} would shadow a package it needs; pick another name")
    # The project's package is imported by its name, from the current directory: one named
    # like a standard-library module or an installed package would hide that one from
    # everything that imports it (`karotte create-env json` broke every json import).
    if package in sys.stdlib_module_names:
        raise ValueError(f"{name!r} makes the package {package!r}, the name of a standard-library "
                         "module it would hide; pick another name")
    if importlib.util.find_spec(package) is not None:
        raise ValueError(f"{name!r} makes the package {package!r}, the name of an installed "
                         "package it would hide; pick another name")
    root = where / name
    if root.exists():
        raise FileExistsError(f"{root} already exists; pick another name or remove it")
    names = {"{{name}}": name, "{{package}}": package,
             "{{Class}}": "".join(p.capitalize() for p in re.split(r"[-_]", name))}
    templates = resources.files("karotte").joinpath("templates", "env")
    for source in _walk(templates):
        rel = source[len("env/"):] if source.startswith("env/") else source
        target = root / _fill(rel.removesuffix(".tmpl"), names)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(_fill(templates.joinpath(rel).read_text(), names))
    return root


def _walk(node, prefix: str = "") -> list[str]:
    out = []
    for child in node.iterdir():
        path = f"{prefix}{child.name}"
        if child.is_dir():
            out += _walk(child, path + "/")
        else:
            out.append(path)
    return out


def _fill(text: str, names: dict[str, str]) -> str:
    for key, value in names.items():
        text = text.replace(key, value)
    return text
