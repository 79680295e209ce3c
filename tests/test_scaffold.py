"""`karotte create-env NAME`: the names it refuses before it writes anything."""
from __future__ import annotations

import pytest

from karotte.scaffold import create_env


@pytest.mark.parametrize("name", ["json", "Json", "asyncio", "sys"])
def test_a_name_of_a_standard_library_module_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="standard-library module it would hide"):
        create_env(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["pytest", "psutil", "Pytest"])
def test_a_name_of_an_installed_package_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="installed package it would hide"):
        create_env(name, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_fresh_name_makes_the_project(tmp_path):
    root = create_env("veggie-count", tmp_path)
    assert (root / "veggie_count" / "__init__.py").is_file()
