"""The notebooks run top to bottom on CPU, offline, and show pictures; the committed copies carry their outputs.

Each notebook is executed with nbclient into a temporary copy (the committed files are never rewritten by a test),
in a kernel that runs this interpreter (a kernelspec written to a temporary folder, so a ``python3`` kernel
registered elsewhere on the machine cannot be picked up), with headless matplotlib and the hub offline.

Refresh the committed outputs with ``python tests/test_notebooks.py`` (optionally naming notebooks); it executes them
in place with the same settings and strips progress-bar output.
"""

from __future__ import annotations

import ast
import copy
import json
import os
import sys
import time
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
NOTEBOOKS = ("explore_packing.ipynb", "inspect_checkpoint.ipynb")
CELL_TIMEOUT_S = 300
"""Per-cell limit: a hang fails the test instead of stalling CI."""
MAX_NOTEBOOK_BYTES = 2_000_000
"""Committed notebooks with outputs stay small (modest-dpi png figures, no text dumps)."""
ALLOWED_IMPORTS = frozenset({"vlm_sft", "renderers", "processors", "matplotlib"}) | frozenset(sys.stdlib_module_names)
"""Notebooks import only the project's packages, matplotlib and the standard library."""


def kernel_env(**extra: str) -> dict[str, str]:
    """The kernel's environment: offline hub, headless matplotlib, no progress bars (tqdm reads this at import)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MPLBACKEND")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "MPLBACKEND": "Agg",
            "TQDM_DISABLE": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
            # tqdm.auto's notice that ipywidgets is missing, printed on import in every kernel.
            "PYTHONWARNINGS": "ignore:IProgress not found",
        }
    )
    env.update(extra)
    return env


def _kernel_manager(spec_dir: Path) -> KernelManager:
    """A manager for a ``python3`` kernel that runs ``sys.executable`` (this venv), defined in ``spec_dir``."""
    kernel = spec_dir / "python3"
    kernel.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "vlm-sft (this interpreter)",
        "language": "python",
    }
    (kernel / "kernel.json").write_text(json.dumps(spec))
    specs = KernelSpecManager(kernel_dirs=[str(spec_dir)], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=specs)


def execute_notebook(nb: nbformat.NotebookNode, spec_dir: Path, **env: str) -> nbformat.NotebookNode:
    """Execute ``nb`` (in place) with the repository root as working directory; raises ``CellExecutionError``."""
    client = NotebookClient(
        nb,
        km=_kernel_manager(spec_dir),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(REPO_ROOT)}},
        record_timing=False,
    )
    client.execute(env=kernel_env(**env))
    return nb


def strip_progress(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop stderr stream outputs that are progress bars (carriage-return redraws)."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [
                o for o in cell.outputs if not (o.output_type == "stream" and o.name == "stderr" and "\r" in o.text)
            ]
    return nb


def image_outputs(nb: nbformat.NotebookNode) -> int:
    return sum(
        1
        for cell in nb.cells
        if cell.cell_type == "code"
        for o in cell.outputs
        if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {})
    )


def notebook_problems(nb: nbformat.NotebookNode) -> list[str]:
    """Why a notebook is not fit to commit: unexecuted cells, errors, progress-bar noise, no picture."""
    problems = []
    for k, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.execution_count is None:
            problems.append(f"cell {k} was not executed")
        for o in cell.outputs:
            if o.output_type == "error":
                problems.append(f"cell {k} raised {o.ename}: {o.evalue}")
            elif o.output_type == "stream" and "\r" in o.text:
                problems.append(f"cell {k} has progress-bar output in {o.name}")
    if image_outputs(nb) == 0:
        problems.append("no image/png output")
    return problems


def foreign_imports(nb: nbformat.NotebookNode) -> set[str]:
    """Top-level packages a notebook imports beyond ``ALLOWED_IMPORTS``."""
    found = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module.split(".")[0])
    return found - ALLOWED_IMPORTS


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(NOTEBOOK_DIR / name, as_version=4)


def _inject(nb: nbformat.NotebookNode, source: str) -> nbformat.NotebookNode:
    """A copy of ``nb`` with a code cell holding ``source`` before its first code cell."""
    nb = copy.deepcopy(nb)
    first = next(k for k, c in enumerate(nb.cells) if c.cell_type == "code")
    nb.cells.insert(first, nbformat.v4.new_code_cell(source))
    return nb


# --------------------------------------------------------------------------------------------------------- tests


def _execute_in(name: str, tmp: Path) -> nbformat.NotebookNode:
    # A missing checkpoint folder makes inspect_checkpoint train its short run, as in CI (outputs/ is not committed);
    # the data copies go to a temporary folder, so concurrent runs never share files. One thread per kernel: the
    # notebooks run side by side, one core each.
    return execute_notebook(
        _read(name),
        tmp / "kernels",
        VLM_SFT_NOTEBOOK_CHECKPOINT=str(tmp / "no-checkpoint"),
        VLM_SFT_NOTEBOOK_DATA=str(tmp / "data"),
        OMP_NUM_THREADS="1",
    )


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> dict[str, nbformat.NotebookNode | BaseException]:
    """Every notebook executed at once, each in its own kernel and folder (a kernel is one process: on 2 cores two
    kernels take the time of one); an exception is kept for the notebook's own test to raise."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = tmp_path_factory.mktemp("notebooks")
    with ThreadPoolExecutor(max_workers=len(NOTEBOOKS)) as pool:
        futures = {name: pool.submit(_execute_in, name, tmp / name.removesuffix(".ipynb")) for name in NOTEBOOKS}
    return {name: f.exception() or f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom_and_draws(name, executed, tmp_path):
    committed = (NOTEBOOK_DIR / name).read_bytes()
    nb = executed[name]
    if isinstance(nb, BaseException):
        raise nb
    nbformat.write(nb, tmp_path / name)
    assert notebook_problems(strip_progress(nb)) == []
    assert image_outputs(nb) >= 1
    assert (NOTEBOOK_DIR / name).read_bytes() == committed, "the test must not rewrite the committed notebook"


def video_cell_problems(nb: nbformat.NotebookNode) -> list[str]:
    """Why ``explore_packing``'s video cell did not show a packed video sample's frames: absent, no picture, or the
    frames drawn are not the pack's own patch rows."""
    cells = [c for c in nb.cells if c.cell_type == "code" and "plot_video(" in c.source]
    if len(cells) != 1:
        return [f"{len(cells)} cells call plot_video"]
    outputs = cells[0].outputs
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    problems = [] if "the pack holds the render's patch rows: True" in text else [f"printed {text!r}"]
    if not any("image/png" in o.get("data", {}) for o in outputs):
        problems.append("no picture of the frames")
    return problems


def test_explore_packing_shows_a_packed_video_samples_frames(executed):
    """The video cell runs in the suite's execution (its clip copied from ``tests/fixtures/video`` beside the data)
    and draws the frames of the pack's video sample; the same check refuses the notebook without its outputs."""
    nb = executed["explore_packing.ipynb"]
    if isinstance(nb, BaseException):
        raise nb
    assert video_cell_problems(nb) == []
    blank = copy.deepcopy(nb)
    for cell in (c for c in blank.cells if c.cell_type == "code"):
        cell.outputs = []
    assert video_cell_problems(blank) == ["printed ''", "no picture of the frames"]


def test_broken_import_fails_the_run(tmp_path):
    nb = _inject(_read(NOTEBOOKS[0]), "import vlm_sft.does_not_exist")
    with pytest.raises(CellExecutionError, match="ModuleNotFoundError"):
        execute_notebook(nb, tmp_path / "kernels")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_carries_its_outputs(name):
    path = NOTEBOOK_DIR / name
    nb = _read(name)
    assert notebook_problems(nb) == [], f"refresh it: python tests/test_notebooks.py {name}"
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
    assert nb.metadata.kernelspec.name == "python3"


def test_notebook_checks_catch_what_they_guard_against():
    nb = _read(NOTEBOOKS[0])
    blank = copy.deepcopy(nb)
    for cell in blank.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    assert "no image/png output" in notebook_problems(blank)
    assert any("was not executed" in p for p in notebook_problems(blank))
    noisy = _inject(nb, "pass")
    noisy.cells[1].execution_count = 1
    noisy.cells[1].outputs = [nbformat.v4.new_output("stream", name="stderr", text="train:  50%|#####\r")]
    assert any("progress-bar" in p for p in notebook_problems(noisy))
    assert notebook_problems(strip_progress(noisy)) == []
    assert foreign_imports(_inject(nb, "import pandas as pd\nfrom seaborn import heatmap")) == {"pandas", "seaborn"}


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_imports_only_project_packages(name):
    assert foreign_imports(_read(name)) == set()


def test_row_segments_list_samples_then_padding():
    from vlm_sft.data.collate import collate
    from vlm_sft.data.pack import Pack
    from vlm_sft.data.shift import shift_sample
    from vlm_sft.data.synthetic import SyntheticSource
    from vlm_sft.viz import row_segments

    source = SyntheticSource(5, distribution="short", pixel_dim=8)
    a, b, c = (shift_sample(source(i)) for i in (0, 1, 2))
    packed = collate([Pack(rows=((a, b),), row_len=100), Pack(rows=((c,),), row_len=100)])
    n_a, n_b, n_c = len(a), len(b), len(c)
    assert row_segments(packed, 0) == [(0, n_a, 0), (n_a, n_a + n_b, 1), (n_a + n_b, 100, None)]
    assert row_segments(packed, 1) == [(0, n_c, 2), (n_c, 100, None)]
    stacked = collate([Pack(rows=((a,), (c,)), row_len=48, stacked=True)])
    assert row_segments(stacked, 1) == [(0, n_c, 2), (n_c, 48, None)]


def test_probe_helpers_score_exactly_the_trained_tokens():
    """Teacher-forced per-token losses sum to the model's own loss; greedy's first token is the teacher-forced argmax
    after the prompt (same prefix, causal model)."""
    import torch

    from processors import load_tiny_processor
    from vlm_sft.data.synthetic import SyntheticSource
    from vlm_sft.model import build_model, tiny_qwen3_5_config
    from vlm_sft.viz import _single_batch, greedy_answer, teacher_forced

    tokenizer = load_tiny_processor().tokenizer
    model = build_model(tiny_qwen3_5_config()).eval()
    sample = next(s for s in map(SyntheticSource(20, distribution="short"), range(20)) if s.num_images)
    scores = teacher_forced(model, sample, tokenizer)
    assert len(scores.losses) == len(scores.targets) == int(sample.loss_mask[1:].sum())
    batch = _single_batch(sample, int(tokenizer.pad_token_id), 2)
    with torch.no_grad():
        loss_sum, count = model(**batch.model_kwargs())
    assert int(count) == len(scores.losses)
    assert sum(scores.losses) == pytest.approx(float(loss_sum), rel=1e-4)
    assert scores.correct == [t == p for t, p in zip(scores.targets, scores.predicted, strict=True)]
    first = greedy_answer(model, sample, tokenizer, max_new_tokens=1)
    assert first == ("" if scores.predicted[0] == "<|im_end|>" else scores.predicted[0])


# ------------------------------------------------------------------------------------------------------ refresh


def refresh(names: list[str]) -> None:
    """Execute the named notebooks in place and save them with their outputs (for committing)."""
    import tempfile

    for name in names:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            nb = strip_progress(execute_notebook(_read(name), Path(tmp)))
        problems = notebook_problems(nb)
        if problems:
            raise SystemExit(f"{name}: {problems}")
        nbformat.write(nb, NOTEBOOK_DIR / name)
        size = (NOTEBOOK_DIR / name).stat().st_size
        print(f"{name}: executed in {time.perf_counter() - start:.1f} s, {size / 1e3:.0f} kB")


if __name__ == "__main__":
    refresh(sys.argv[1:] or list(NOTEBOOKS))
