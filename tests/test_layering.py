"""Imports point one way: the command-line entry points on top, then the trainer, then data and model side by side.

The model never imports the data package (it takes positions and segment lengths as inputs, it does not build
them), the data package never imports the model or the trainer, and nothing below the top imports an entry point.
"""

from __future__ import annotations

import ast

import pytest

from vlm_sft.config import REPO_ROOT

PACKAGE = REPO_ROOT / "vlm_sft"
ENTRY_POINTS = ("vlm_sft.train", "vlm_sft.report", "vlm_sft.check_packing", "vlm_sft.viz")
FORBIDDEN = {
    "vlm_sft/model": ("vlm_sft.data", "vlm_sft.trainer", *ENTRY_POINTS),
    "vlm_sft/data": ("vlm_sft.model", "vlm_sft.trainer", *ENTRY_POINTS),
    "vlm_sft/trainer": ENTRY_POINTS,
}


def imported_modules(source: str) -> set[str]:
    """Every module named by an import statement (at any depth: lazy imports inside functions count too)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_one_way(folder):
    bad = []
    for path in sorted((REPO_ROOT / folder).glob("*.py")):
        for name in imported_modules(path.read_text()):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
    assert not bad, bad


def test_the_scan_sees_lazy_imports():
    assert "vlm_sft.data.mrope" in imported_modules("def f():\n    from vlm_sft.data.mrope import x\n")
