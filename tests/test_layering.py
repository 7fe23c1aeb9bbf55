"""Imports point one way: the command-line entry points on top, then the trainer, then checks and checkpoints, then
the parallel package, then the model; the data package beside them.

- The model imports none of data, trainer, checkpoint, parallel or checks, nor ``torch.distributed`` at all: it takes
  positions and segment lengths as inputs, reads and writes no files, and is spread over ranks from outside
  (``parallel.parallelize``).
- ``parallel`` is the only package that imports ``torch.distributed``; it knows the model (its module paths, its
  token mixers) but not the data, the checkpoints, the checks or the trainer.
- ``checkpoint`` (the run's model from a preset or a checkpoint, and every file a checkpoint holds) uses ``parallel``
  and the model, never the trainer; ``checks`` uses the
  model, the data and ``parallel``, never the trainer; the data package never imports the model, the trainer or the
  checks.
- The data report and the packing check do not import the trainer. Nothing below the top imports an entry point,
  and no module imports itself back, directly or through others
  (``test_no_import_circles``; lazy imports inside functions and imports for type annotations only, under
  ``if TYPE_CHECKING:``, count too: a circle of annotations is still two modules that cannot be read apart).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from vlm_sft.config import REPO_ROOT

PACKAGE = REPO_ROOT / "vlm_sft"
ENTRY_POINTS = (
    "vlm_sft.train", "vlm_sft.report", "vlm_sft.check_packing", "vlm_sft.viz", "vlm_sft.generate", "vlm_sft.plot",
    "vlm_sft.evaluate",
)  # fmt: skip
TORCH_DISTRIBUTED = "torch.distributed"
FORBIDDEN = {
    "vlm_sft/model": (
        "vlm_sft.data", "vlm_sft.trainer", "vlm_sft.checkpoint", "vlm_sft.parallel", "vlm_sft.checks",
        TORCH_DISTRIBUTED, *ENTRY_POINTS,
    ),
    "vlm_sft/data": ("vlm_sft.model", "vlm_sft.trainer", "vlm_sft.checkpoint", "vlm_sft.parallel", "vlm_sft.checks",
                     TORCH_DISTRIBUTED, *ENTRY_POINTS),
    "vlm_sft/parallel": ("vlm_sft.data", "vlm_sft.trainer", "vlm_sft.checkpoint", "vlm_sft.checks", *ENTRY_POINTS),
    "vlm_sft/checkpoint": ("vlm_sft.data", "vlm_sft.trainer", "vlm_sft.checks", TORCH_DISTRIBUTED, *ENTRY_POINTS),
    "vlm_sft/checks": ("vlm_sft.trainer", "vlm_sft.checkpoint", TORCH_DISTRIBUTED, *ENTRY_POINTS),
    "vlm_sft/trainer": (TORCH_DISTRIBUTED, *ENTRY_POINTS),
}  # fmt: skip


def imported_modules(source: str, *, with_type_checking: bool = True) -> set[str]:
    """Every module named by an import statement (at any depth: lazy imports inside functions count too; those under
    ``if TYPE_CHECKING:``, which never run, unless ``with_type_checking`` is False)."""
    tree = ast.parse(source)
    if not with_type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_one_way(folder):
    bad = []
    for path in sorted((REPO_ROOT / folder).glob("*.py")):
        for name in imported_modules(path.read_text()):
            if any(_matches(name, f) for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(REPO_ROOT)} imports {name}")
    assert not bad, bad


@pytest.mark.parametrize("tool", ["vlm_sft/report.py", "vlm_sft/check_packing.py"])
def test_the_data_tools_do_not_import_the_trainer(tool):
    """The data report and the packing check build their data through ``data.build`` (and the check its model through
    ``checkpoint.build``), not through the trainer."""
    names = imported_modules((REPO_ROOT / tool).read_text())
    assert not [n for n in names if _matches(n, "vlm_sft.trainer")]
    assert any(_matches(n, "vlm_sft.data.build") for n in names)


def test_only_the_parallel_package_imports_torch_distributed():
    """The folders above hold every package but ``parallel``; the top-level modules are checked here."""
    assert {p.parent for p in PACKAGE.glob("*/*.py")} == {REPO_ROOT / f for f in FORBIDDEN} | {PACKAGE / "parallel"}
    bad = [
        f"{path.relative_to(REPO_ROOT)} imports {name}"
        for path in sorted(PACKAGE.glob("*.py"))
        for name in imported_modules(path.read_text())
        if _matches(name, TORCH_DISTRIBUTED)
    ]
    assert not bad, bad


def module_name(path: Path, root: Path = REPO_ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules of ``sources`` it imports (``from a.b import c`` names ``a.b.c`` when that is a module,
    else ``a.b``), lazily or for type annotations only (``if TYPE_CHECKING:``) included."""
    return {
        module: {n for n in imported_modules(source) if n in sources and n != module}
        for module, source in sources.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    roots = [PACKAGE, REPO_ROOT / "renderers", REPO_ROOT / "processors"]
    sources = {module_name(p): p.read_text() for root in roots for p in sorted(root.rglob("*.py"))}
    assert "vlm_sft.parallel.parallelize" in sources and "vlm_sft.trainer.setup" in sources
    assert find_cycle(import_graph(sources)) is None


def test_the_checks_can_fail():
    """The scans see lazy imports, a circle through three modules, and ``torch.distributed`` behind an alias."""
    assert "vlm_sft.data.mrope" in imported_modules("def f():\n    from vlm_sft.data.mrope import x\n")
    graph = import_graph({"a": "import b", "b": "def f():\n    from c import x", "c": "from a import y", "d": ""})
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle(import_graph({"a": "import b", "b": "", "c": "import a"})) is None
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import a\n"
    assert find_cycle(import_graph({"a": "import b", "b": typed})) == ["a", "b", "a"]
    assert any(_matches(n, TORCH_DISTRIBUTED) for n in imported_modules("import torch.distributed as dist"))
    assert any(_matches(n, TORCH_DISTRIBUTED) for n in imported_modules("from torch.distributed.tensor import DTensor"))


def test_a_circle_of_type_annotations_only_is_found(tmp_path):
    """A package tree on disk whose only circle is two ``if TYPE_CHECKING:`` imports (the shape of the old
    ``model.decode`` <-> ``model.vlm`` one): the scan that ``test_no_import_circles`` runs reports it; with the
    annotation imports left out (the old rule) it would see none."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "cache.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg.model import Model\n"
    )
    (package / "model.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg import cache\n")
    (package / "other.py").write_text("from pkg.cache import x\n")
    sources = {module_name(p, tmp_path): p.read_text() for p in sorted(package.rglob("*.py"))}
    assert find_cycle(import_graph(sources)) == ["pkg.cache", "pkg.model", "pkg.cache"]
    without_annotations = {m: imported_modules(text, with_type_checking=False) for m, text in sources.items()}
    assert not any(n in sources for n in without_annotations["pkg.cache"] | without_annotations["pkg.model"])


MODEL_PATH_ATTRIBUTES = ("language_model", "visual")
"""The model's submodules that ``parallel.parallelize`` alone names outside the model (``decoder_layers``, ...)."""


def code_names(source: str) -> tuple[set[str], set[str]]:
    """The string constants (docstrings left out) and the attribute names a module's code uses."""
    tree = ast.parse(source)
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    strings = {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    }
    return strings, {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}


def model_paths_named(source: str) -> list[str]:
    strings, attributes = code_names(source)
    named = [a for a in MODEL_PATH_ATTRIBUTES if a in attributes]
    return named + sorted(s for s in strings if any(a in s.split(".") for a in MODEL_PATH_ATTRIBUTES))


def test_only_parallelize_names_the_model_paths():
    """Outside the model, ``model.language_model.layers`` and ``model.visual`` are spelled in ``parallelize.py``
    alone; the trainer, the checks and the checkpoints ask it (``decoder_layers``, ``vision_tower``, ...)."""
    owner = PACKAGE / "parallel" / "parallelize.py"
    bad = {
        str(path.relative_to(REPO_ROOT)): named
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != owner and PACKAGE / "model" not in path.parents and (named := model_paths_named(path.read_text()))
    }
    assert not bad, bad
    assert model_paths_named(owner.read_text())


def mesh_names_spelled(source: str) -> set[str]:
    from vlm_sft.parallel.mesh import CP, DP, EDP, EP

    return code_names(source)[0] & {DP, CP, EP, EDP}


def test_mesh_dimensions_are_named_once():
    """The mesh's dimension names are spelled once, as ``parallel.mesh``'s constants, and used by name everywhere."""
    owner = PACKAGE / "parallel" / "mesh.py"
    bad = {
        str(p.relative_to(REPO_ROOT)): names
        for p in sorted(PACKAGE.rglob("*.py"))
        if p != owner and (names := mesh_names_spelled(p.read_text()))
    }
    assert not bad, bad
    definitions = [line for line in owner.read_text().splitlines() if re.fullmatch(r'[A-Z]+ = "[a-z]+"', line)]
    assert definitions == ['DP = "dp"', 'CP = "cp"', 'EP = "ep"', 'EDP = "edp"']


def test_the_name_scans_can_fail():
    """Bare paths and mesh names in code are found; the same words in a docstring are not."""
    assert model_paths_named("layers = model.model.language_model.layers") == ["language_model"]
    assert model_paths_named('tower = model.get_submodule("model.visual")') == ["model.visual"]
    assert model_paths_named('def f():\n    """``model.visual``, ``model.language_model``"""\n') == []
    assert mesh_names_spelled('rank = mesh.get_local_rank("cp")') == {"cp"}
    assert mesh_names_spelled('"""The ``ep`` group."""\nrank = mesh.get_local_rank(CP)') == set()
