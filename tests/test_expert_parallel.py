"""Expert parallelism (``train.ep_size``, ``vlm_sft/parallel/expert_parallel.py``) on the CPU over gloo.

- Routing edge cases, against the plain experts on one process: random routing, an expert that receives no token,
  a rank whose experts receive none, every slot to one expert (``ep_worker.py``: outputs, input and routing-weight
  gradients, and each expert's gradient).
- The trainer: ep 2 on 2 processes == 1 process with 2 micro-batches (losses, router statistics, gradient norms and
  the final weights), with activation checkpointing on; ep 2 with 2 micro-batches and ep 2 x dp 2 on 4 processes ==
  1 process with 4; under ep 2 x dp 2 each expert row is held (and saved) by one rank only; an ep 2 checkpoint and an
  ep 2 x dp 2 one resumed on 1 process, and a 1-process one resumed with ep 2, continue with the uninterrupted
  losses; a checkpoint loaded with ep 2 x dp 2 and exported after a step at lr 0 is the input bit for bit; a dense
  model, or sizes that do not divide, are refused with the fix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import Background, launch_env, read_metrics, tiny_run_args

from vlm_sft.config import REPO_ROOT, ConfigError, load_config
from vlm_sft.model import tiny_qwen3_5_moe_config
from vlm_sft.model.moe import Experts, sorted_experts_mlp
from vlm_sft.parallel.dcp import SafeReader
from vlm_sft.parallel.mesh import ParallelDims

WORKER = str(Path(__file__).resolve().parent / "ep_worker.py")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ep_worker import CASES, inputs  # noqa: E402 (the worker's own cases and inputs)

# ------------------------------------------------------------------------------------------- routing


@pytest.fixture(scope="module")
def ep_results(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ep")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER]
    proc = subprocess.run(cmd, env=launch_env() | {"EP_OUT": str(out)}, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-6000:]
    return out


def _reference(case: str, ranks: int = 2) -> dict[str, torch.Tensor]:
    """The worker's computation on one process: every rank's tokens through the whole experts, the same loss."""
    cfg = tiny_qwen3_5_moe_config().text_config
    torch.manual_seed(0)
    module = Experts(cfg).double()
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.1)
    x_TD, experts_TK, weights_TK = inputs(case, cfg)
    out: dict[str, list] = {"y": [], "x_grad": [], "w_grad": []}
    for rank in range(ranks):
        mine = slice(rank, None, ranks)
        x_tD, w_tK = x_TD[mine].clone().requires_grad_(), weights_TK[mine].clone().requires_grad_()
        y_tD = sorted_experts_mlp(x_tD, module.gate_up_proj, module.down_proj, experts_TK[mine], w_tK)
        (y_tD * torch.arange(1, y_tD.numel() + 1, dtype=y_tD.dtype).view_as(y_tD)).sum().backward()
        out["y"].append(y_tD.detach())
        out["x_grad"].append(x_tD.grad)
        out["w_grad"].append(w_tK.grad)
    return out | {"gate_up_proj": module.gate_up_proj.grad, "down_proj": module.down_proj.grad}


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_routing_equals_the_plain_experts(ep_results, case):
    reference = _reference(case)
    for rank in range(2):
        got = torch.load(ep_results / f"{case}-rank{rank}.pt")
        for key in ("y", "x_grad", "w_grad"):
            torch.testing.assert_close(got[key], reference[key][rank], rtol=1e-12, atol=1e-12, msg=f"{case} {key}")
        for key in ("gate_up_proj", "down_proj"):
            torch.testing.assert_close(got[key], reference[key], rtol=1e-12, atol=1e-12, msg=f"{case} {key}")
    if case == "rank1_idle":  # the idle rank's experts got a zero gradient, not None (its collectives still ran)
        assert reference["down_proj"][2:].abs().max() == 0


# ------------------------------------------------------------------------------------------- the trainer

COMMON = {
    "model.name_or_path": "tiny-moe", "model.router_aux_loss_coef": 0.01, "data.shuffle": False,
    "data.shapes.num_train": 64, "train.max_steps": 3, "train.save_every": 2, "train.check_packing": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory) -> dict[str, Path]:
    """1 process with 2 micro-batches, and ep 2 on 2 processes (activation checkpointing on): the same global batch.
    Then the ep 2 run's step-2 checkpoint resumed on 1 process, the 1-process run's resumed with ep 2, and the
    1-process run's final/ loaded with ep 2 x dp 2 on 4 processes for a step at lr 0."""
    root = tmp_path_factory.mktemp("ep_runs")
    layouts = {
        "1": (1, {"train.micro_batches": 2}),
        "ep2": (2, {"train.ep_size": 2, "model.activation_checkpointing": True}),
    }
    runs = {n: Background(tiny_run_args(root / n, **COMMON, **extra), nproc=p) for n, (p, extra) in layouts.items()}
    for run in runs.values():
        run.wait(300)
    checkpoint = root / "ep2" / "run" / "checkpoints" / "step-000002"
    resumed = {"train.micro_batches": 2, "train.resume": str(checkpoint)}
    frozen = {  # the 1-process run's final/ loaded (each rank reads its experts), one step at lr 0, exported
        "model.name_or_path": str(root / "1" / "run" / "final"), "model.initializer_range": "none", "train.lr": 0.0,
        "train.max_steps": 1,
        "train.ep_size": 2,
    }  # fmt: skip
    reverse = {"train.ep_size": 2, "train.resume": str(root / "1" / "run" / "checkpoints" / "step-000002")}
    later = [Background(tiny_run_args(root / "resumed", **COMMON, **resumed))]
    later.append(Background(tiny_run_args(root / "reverse", **COMMON, **reverse), nproc=2))
    later.append(Background(tiny_run_args(root / "lr0", **(COMMON | frozen)), nproc=4))
    for run in later:
        run.wait(420)
    return {name: root / name / "run" for name in (*layouts, "resumed", "reverse", "lr0")}


def _losses(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["aux_loss"]) for r in read_metrics(run) if "loss" in r]


def test_ep2_equals_one_process(ep_runs):
    one, ep2 = _losses(ep_runs["1"]), _losses(ep_runs["ep2"])
    assert [r[0] for r in one] == [r[0] for r in ep2] == [1, 2, 3]
    for a, b in zip(one, ep2, strict=True):
        assert b[1:] == pytest.approx(a[1:], rel=1e-5), (a, b)
    weights = [load_file(next((ep_runs[n] / "final").glob("*.safetensors"))) for n in ("1", "ep2")]
    assert weights[0].keys() == weights[1].keys()
    experts = [k for k in weights[0] if ".experts." in k]
    assert experts  # the export writes per-expert keys, whatever the layout was
    for key in weights[0]:  # fp32 sums in another order, through 3 AdamW steps of lr 1e-3: a few 1e-7 apart
        torch.testing.assert_close(weights[1][key], weights[0][key], rtol=1e-5, atol=3e-6, msg=key)


@pytest.fixture(scope="module")
def wide_runs(tmp_path_factory) -> dict[str, Path]:
    """A global batch of 4 packs three ways: 1 process with 4 micro-batches; ep 2 on 2 processes with 2 micro-batches
    each (gradients accumulated before the expert reduction); ep 2 x dp 2 on 4 processes (each rank's 2 experts
    FSDP2-sharded over the 2 ``edp`` ranks, reduced there), with a checkpoint after step 1 that 1 process resumes."""
    root = tmp_path_factory.mktemp("ep_wide")
    steps = {"train.max_steps": 2, "train.save_every": "none"}
    layouts = {
        "1x4": (1, {"train.micro_batches": 4}),
        "ep2_mb2": (2, {"train.ep_size": 2, "train.micro_batches": 2}),
        "ep2_dp2": (4, {"train.ep_size": 2, "train.save_every": 1}),
    }
    runs = [
        Background(tiny_run_args(root / n, **(COMMON | steps | extra)), nproc=p) for n, (p, extra) in layouts.items()
    ]
    for run in runs:
        run.wait(420)
    checkpoint = root / "ep2_dp2" / "run" / "checkpoints" / "step-000001"
    resumed = {"train.micro_batches": 4, "train.resume": str(checkpoint)}
    Background(tiny_run_args(root / "resumed", **(COMMON | steps | resumed))).wait(300)
    return {name: root / name / "run" for name in (*layouts, "resumed")}


@pytest.mark.parametrize("layout", ["ep2_mb2", "ep2_dp2"])
def test_ep2_with_micro_batches_or_copies_equals_one_process(wide_runs, layout):
    one, ep = _losses(wide_runs["1x4"]), _losses(wide_runs[layout])
    assert [r[0] for r in one] == [r[0] for r in ep] == [1, 2]
    for a, b in zip(one, ep, strict=True):
        assert b[1:] == pytest.approx(a[1:], rel=1e-5), (layout, a, b)


def test_ep2_x_dp2_shards_each_expert_once_and_resumes_on_one_process(wide_runs):
    """Every expert row is saved by exactly one of the 4 ranks (copies of the experts on the 2 ``edp`` ranks would be
    2 chunks of 2 rows, saved once each); the checkpoint resumes on 1 process to the uninterrupted step 2."""
    metadata = SafeReader(str(wide_runs["ep2_dp2"] / "checkpoints" / "step-000001")).read_metadata()
    experts = {k: v for k, v in metadata.state_dict_metadata.items() if k.startswith("model.") and ".experts." in k}
    assert experts and all(v.size[0] == 4 for v in experts.values())
    for key, value in experts.items():
        assert sorted((c.offsets[0], c.sizes[0]) for c in value.chunks) == [(e, 1) for e in range(4)], key
    resumed = _losses(wide_runs["resumed"])
    assert [r[0] for r in resumed] == [2]
    assert resumed[0][1:] == pytest.approx(_losses(wide_runs["1x4"])[1][1:], rel=1e-5)


def test_an_ep2_checkpoint_resumes_on_one_process_and_the_reverse(ep_runs):
    for name, source in (("resumed", "ep2"), ("reverse", "1")):
        resumed = _losses(ep_runs[name])
        assert [r[0] for r in resumed] == [3], name
        assert resumed[0][1:] == pytest.approx(_losses(ep_runs["1"])[2][1:], rel=1e-5), name
        state = json.loads((ep_runs[source] / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
        assert state["world_size"] == {"ep2": 2, "1": 1}[source]


def test_an_ep2_export_at_lr_0_is_the_input_checkpoint_bit_for_bit(ep_runs):
    """The sharded load puts each expert row on its rank (ep 2 x dp 2: one of 4 rows per rank), the streamed export
    gathers it back: nothing changes a bit."""
    source, exported = ({} for _ in range(2))
    for folder, out in ((ep_runs["1"] / "final", source), (ep_runs["lr0"] / "final", exported)):
        for path in sorted(folder.glob("*.safetensors")):
            out.update(load_file(path))
    assert source.keys() == exported.keys() and any(".experts.0." in k for k in source)
    for key, value in source.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key


def test_sizes_that_do_not_fit_are_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="launch a multiple of 2 processes"):
        ParallelDims.for_world(3, ep_size=2)
    with pytest.raises(ConfigError, match="not combined yet"):
        load_config("configs/debug_moe.toml", ["--train.ep_size", "2", "--train.cp_size", "2"])
    dense = Background(tiny_run_args(tmp_path, **{"train.ep_size": 2}), nproc=2).wait(300, check=False)
    assert dense.returncode != 0 and "config error: train.ep_size = 2 needs a Qwen3.5-MoE model" in dense.stderr


def test_the_plan_counts_each_ranks_experts_and_the_dispatch():
    """The memory plan under expert parallelism (estimates, no model built): each rank holds 1/W of the experts
    (1/ep split over edp: no copies where ep is below the world size), FSDP2 gathers 1/ep of a layer's experts, the
    dispatch adds its buffers; a dense model is unchanged."""
    from vlm_sft.checks.memory_plan import plan_for_run

    def planned(name: str, world: int, ep: int):
        cfg = load_config("configs/qwen3_5_35b_a3b.toml", ["--model.name_or_path", name, "--train.ep_size", str(ep)])
        return plan_for_run(cfg, world)

    moe = "Qwen/Qwen3.5-35B-A3B"
    fsdp, ep8 = planned(moe, 8, 1), planned(moe, 8, 8)
    assert ep8.params == pytest.approx(fsdp.params, rel=1e-3)  # ep = W: the same share, held by expert
    assert ep8.gathered_weights < 0.55 * fsdp.gathered_weights  # 1/8 of a layer's experts, the rest as before
    assert ep8.expert_dispatch > 0 and fsdp.expert_dispatch == 0
    over_edp, whole, plain = planned(moe, 16, 8), planned(moe, 16, 16), planned(moe, 16, 1)
    assert over_edp.params == whole.params == plain.params  # edp 2 shards the experts: no copies
    assert over_edp.gathered_weights > whole.gathered_weights  # but gathers 1/8 of a layer's experts, not 1/16
    dense = "Qwen/Qwen3.5-27B"
    assert planned(dense, 8, 8).to_dict() == planned(dense, 8, 1).to_dict()
