"""Whether the packages an experiment's steps import are compiled again in every process (experiments.machine)."""

from __future__ import annotations

import compileall
import sys
from pathlib import Path

import pytest

from experiments.machine import bytecode_warning, uncompiled


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable package ``fresh_pkg`` with no bytecode, in a folder of its own on ``sys.path``."""
    (tmp_path / "fresh_pkg").mkdir()
    (tmp_path / "fresh_pkg" / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    return tmp_path


def test_a_package_without_bytecode_is_found_only_where_python_writes_none(package: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert uncompiled(("fresh_pkg",)) == {}  # the first import writes it; later processes read it
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert uncompiled(("fresh_pkg",)) == {"fresh_pkg": package}
    line = bytecode_warning(("fresh_pkg", "no_such_package_here"))
    assert line is not None and line.startswith("fresh_pkg have no bytecode")
    assert f"-m compileall -q {package}" in line and "PYTHONDONTWRITEBYTECODE" in line
    assert compileall.compile_dir(str(package / "fresh_pkg"), quiet=1)
    assert uncompiled(("fresh_pkg",)) == {} and bytecode_warning(("fresh_pkg",)) is None

