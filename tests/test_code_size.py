"""The house rules on size (STYLE.md): no module of the package, the renderers, the processors or the benches over
500 lines, no function over 80. A file that grows past them is split by concept, not trimmed of its docstrings."""

from __future__ import annotations

import ast

from vlm_sft.config import REPO_ROOT

ROOTS = ("vlm_sft", "renderers", "processors", "bench")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> dict[str, str]:
    return {
        str(p.relative_to(REPO_ROOT)): p.read_text() for root in ROOTS for p in sorted((REPO_ROOT / root).rglob("*.py"))
    }


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """``(name, lines)`` of every function or method longer than ``limit`` lines (decorators not counted)."""
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    return [(n.name, n.end_lineno - n.lineno + 1) for n in nodes if n.end_lineno - n.lineno + 1 > limit]


def test_no_module_is_longer_than_500_lines():
    sources = _sources()
    assert "vlm_sft/model/gdn.py" in sources and "bench/harness.py" in sources
    long = {path: text.count("\n") for path, text in sources.items() if text.count("\n") > MAX_FILE_LINES}
    assert not long, f"split these modules by concept (at most {MAX_FILE_LINES} lines): {long}"


def test_no_function_is_longer_than_80_lines():
    long = {path: found for path, text in _sources().items() if (found := long_functions(text))}
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_the_size_checks_can_fail():
    """An 81-line function and an 81-line method are found; a short one is not."""
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    assert long_functions(f"def f():\n{body}") == [("f", 81)]
    method = "".join(f"    {line}\n" for line in f"def g(self):\n{body}".splitlines())
    assert long_functions(f"class A:\n{method}") == [("g", 81)]
    assert long_functions("def f():\n    return 1\n") == []
