"""The house's shape, kept by tests: layers that only point down and no circles (import-linter's contracts in
pyproject.toml, drawn in docs/architecture.md), and the layers as the package's folders."""

from __future__ import annotations

from pathlib import Path

import tomllib
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_imports_only_point_down_the_layers_and_never_in_a_circle(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # import-linter reads pyproject.toml from the working directory
    exit_code = lint_imports(no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report[-4000:]
    assert "Contracts: 3 kept, 0 broken." in report


def test_the_top_of_the_package_is_its_layers_and_the_entry_modules():
    """A newcomer sees the layers in the tree: every subpackage of ``pipeline`` is a layer of the contract,
    and beside them only the entry modules (and Hydra's plugins) live."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]
    layers = {name.strip() for layer in contract["layers"] for name in layer.split(":")}
    top = {p.name for p in (ROOT / "pipeline").iterdir() if p.name != "__pycache__"}
    packages = {name for name in top if (ROOT / "pipeline" / name / "__init__.py").exists()}
    assert {f"pipeline.{name}" for name in packages} <= layers, packages
    assert top - packages == {"__init__.py", "__main__.py", "api.py", "sync.py", "reshuffle.py", "plugins"}, top
    assert len(top) <= 13
