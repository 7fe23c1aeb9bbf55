"""Imports point one way: the command-line entry points on top, then the trainer, then data and model side by side.

The model never imports the data package (it takes positions and segment lengths as inputs, it does not build
them) nor the checkpoint package (it reads and writes no files), the data package never imports the model or the
trainer, the checkpoint package sits between the model and the trainer (it uses only the trainer's collective
rules, ``trainer.distributed``), and nothing below the top imports an entry point.
"""

from __future__ import annotations

import ast

import pytest

from vlm_sft.config import REPO_ROOT

PACKAGE = REPO_ROOT / "vlm_sft"
ENTRY_POINTS = ("vlm_sft.train", "vlm_sft.report", "vlm_sft.check_packing", "vlm_sft.viz")
FORBIDDEN = {
    "vlm_sft/model": ("vlm_sft.data", "vlm_sft.trainer", "vlm_sft.checkpoint", *ENTRY_POINTS),
    "vlm_sft/checkpoint": ("vlm_sft.data", "vlm_sft.trainer", *ENTRY_POINTS),
    "vlm_sft/data": ("vlm_sft.model", "vlm_sft.trainer", *ENTRY_POINTS),
    "vlm_sft/trainer": ENTRY_POINTS,
}
ALLOWED = {"vlm_sft/checkpoint": ("vlm_sft.trainer.distributed",)}
"""Exceptions to ``FORBIDDEN``: where the collective rules live (``DistEnv``, ``all_ranks_or_none``)."""


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
            allowed = any(name == a or name.startswith(a + ".") for a in ALLOWED.get(folder, ()))
            if not allowed and any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
    assert not bad, bad


def test_the_scan_sees_lazy_imports():
    assert "vlm_sft.data.mrope" in imported_modules("def f():\n    from vlm_sft.data.mrope import x\n")
