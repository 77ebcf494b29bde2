"""The house's shape, kept by tests: layers that only point down and no circles (import-linter's contracts in
pyproject.toml, drawn in docs/architecture.md), and no module past 400 lines."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_imports_only_point_down_the_layers_and_never_in_a_circle(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # import-linter reads pyproject.toml from the working directory
    exit_code = lint_imports(no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report[-4000:]
    assert "Contracts: 2 kept, 0 broken." in report


def test_no_module_is_over_400_lines():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in ("pipeline", "transforms")
        for path in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 30 and max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]
