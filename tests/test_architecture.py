"""The house's shape, kept by tests: layers that only point down and no circles (import-linter's contracts in
pyproject.toml, drawn in docs/architecture.md), and the layers as the package's folders."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_imports_only_point_down_the_layers_and_never_in_a_circle(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # import-linter reads pyproject.toml from the working directory
    exit_code = lint_imports(no_cache=True, no_logo=True)
    report = capsys.readouterr().out
    assert exit_code == 0, report[-4000:]
    assert "Contracts: 4 kept, 0 broken." in report


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


def signatures() -> list[tuple[str, int, int]]:
    """Every function of ``pipeline/`` and ``transforms/`` (name, positional parameters besides self/cls)
    and every dataclass (name, fields a caller may give by position)."""
    found = []
    for path in [*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "transforms").rglob("*.py")]:
        where = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.posonlyargs + node.args.args if a.arg not in ("self", "cls")]
                found.append((f"{where}:{node.name}", len(names), 6))
            elif isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                if any("kw_only=True" in ast.unparse(d) for d in node.decorator_list):
                    continue
                fields = []
                for item in node.body:
                    if isinstance(item, ast.AnnAssign):
                        if ast.unparse(item.annotation) == "KW_ONLY":
                            break
                        fields.append(item)
                found.append((f"{where}:{node.name}", len(fields), 4))
    return found


def test_no_function_takes_more_than_six_positional_parameters_nor_a_dataclass_four_positional_fields():
    """Past a few, arguments are named at the call: keyword-only parameters, ``kw_only`` dataclasses."""
    found = signatures()
    assert len(found) > 300  # the walk saw the package
    wide = [(name, count) for name, count, most in found if count > most]
    assert not wide, wide
