"""The streamed HF export (``vlm_sft.checkpoint.export``): what it writes equals the checkpoint the model was loaded
from, bit for bit and key for key (``mtp.*`` included), in shards transformers loads, the same from 2 ranks as from
one process, with rank 0's host peak bounded by a shard instead of the whole model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from train_helpers import Background, launch_env, tiny_run_args
from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

from vlm_sft.checkpoint.export import plan_export, plan_shards, save_pretrained
from vlm_sft.checkpoint.hf_dir import INDEX_FILE, SINGLE_FILE, CheckpointIndex, load_hf_state_dict
from vlm_sft.checkpoint.load import from_pretrained, meta_model
from vlm_sft.checkpoint.lora_export import merged_state_dict
from vlm_sft.config import REPO_ROOT, LoraSettings
from vlm_sft.data.mrope import batch_position_ids
from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.model.backends import resolve_backends
from vlm_sft.model.lora import attach_lora

WORKER = str(Path(__file__).resolve().parent / "export_worker.py")
EXPERTS = "model.language_model.layers.0.mlp.experts"
A_LOG = "model.language_model.layers.0.linear_attn.A_log"
MTP = {
    "mtp.fc.weight": (torch.bfloat16, (64, 128)),
    "mtp.layers.0.mlp.down_proj.weight": (torch.bfloat16, (64, 128)),
    "mtp.norm.weight": (torch.float32, (64,)),
}
"""A multi-token-prediction head as the hub checkpoints carry one (the model drops it on load), one tensor in fp32."""
FAMILIES = {"dense": (tiny_qwen3_5_config, Qwen3_5ForConditionalGeneration)}
FAMILIES["moe"] = (tiny_qwen3_5_moe_config, Qwen3_5MoeForConditionalGeneration)


def bf16_checkpoint(directory: Path, family: str) -> Path:
    """transformers' own bf16 save of a random tiny model, plus ``mtp.*`` tensors and one fp32 tensor (``A_log``,
    as checkpoints that keep the GatedDeltaNet decay in fp32 hold it): the export must keep every tensor's dtype."""
    make_config, cls = FAMILIES[family]
    torch.manual_seed(7)
    cls(make_config()).to(torch.bfloat16).save_pretrained(directory)
    state = load_file(directory / SINGLE_FILE)
    state[A_LOG] = state[A_LOG].float()
    gen = torch.Generator().manual_seed(8)
    state |= {k: torch.randn(shape, generator=gen).to(dtype) for k, (dtype, shape) in MTP.items()}
    save_file(state, directory / SINGLE_FILE, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> Path:
    return bf16_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys(), sorted(set(got) ^ set(expected))
    wrong = [k for k, v in expected.items() if got[k].dtype != v.dtype or not torch.equal(got[k], v)]
    assert not wrong, wrong[:5]


def test_export_is_bit_identical_to_the_loaded_bf16_checkpoint(checkpoint, tmp_path):
    """Loaded into fp32 master weights and exported with the checkpoint as ``source``: every tensor comes back in its
    stored dtype (bf16, the fp32 ``A_log``), MoE experts per expert, ``mtp.*`` copied. Without a source the same
    weights are written in fp32 and the ``mtp.*`` head is lost: what the source fixes."""
    model = from_pretrained(checkpoint)
    source = CheckpointIndex.open(checkpoint)
    save_pretrained(model, tmp_path / "out", source=source)
    expected = load_hf_state_dict(checkpoint)
    assert_same_tensors(load_hf_state_dict(tmp_path / "out"), expected)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    if "moe" in json.loads((checkpoint / "config.json").read_text())["model_type"]:
        assert f"{EXPERTS}.3.gate_proj.weight" in expected and f"{EXPERTS}.gate_up_proj" not in expected

    with pytest.raises(ValueError, match="it is the source checkpoint"):  # it would delete what it copies mtp from
        save_pretrained(model, checkpoint, source=source)

    save_pretrained(model, tmp_path / "plain")
    plain = load_hf_state_dict(tmp_path / "plain")
    assert {t.dtype for t in plain.values()} == {torch.float32} and not any(k.startswith("mtp.") for k in plain)
    assert all(torch.equal(plain[k].to(v.dtype), v) for k, v in expected.items() if k in plain)


@torch.no_grad()
def test_sharded_export_loads_in_transformers_with_our_logits(checkpoint, tmp_path):
    """A small ``max_shard_size`` gives transformers' sharded layout, which its ``from_pretrained`` loads with no
    missing or unexpected key and the logits of our model; a second save into the directory replaces every file."""
    model = from_pretrained(checkpoint).eval()
    source = CheckpointIndex.open(checkpoint)
    out = save_pretrained(model, tmp_path, source=source, max_shard_size="100KB")
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(source.entries)
    assert index["metadata"]["total_size"] == source.total_bytes
    for name in files:  # bounded shards: over the limit only as a single tensor
        tensors = load_file(out / name)
        assert len(tensors) == 1 or sum(t.nbytes for t in tensors.values()) <= 100_000, name

    cls = FAMILIES["moe" if "Moe" in type(model.config).__name__ else "dense"][1]
    theirs, info = cls.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    assert set(info["unexpected_keys"]) <= set(MTP)  # transformers drops the mtp head too
    if hasattr(theirs, "set_experts_implementation"):
        theirs.set_experts_implementation("eager")
    ids = torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(0))
    mine = model(ids, position_ids=batch_position_ids(torch.zeros_like(ids)))
    ref = theirs.eval()(input_ids=ids).logits
    assert float(ref.abs().max()) > 0.1 and float((mine - ref).abs().max()) <= 1e-5

    save_pretrained(model, out, source=source)  # one file now: the shards and the index of the first save go
    assert sorted(p.name for p in out.glob("model*")) == [SINGLE_FILE]


def test_lora_merge_streams_what_merged_state_dict_gives(tmp_path):
    """The streamed merge (per module: base, A, B) equals the whole-state-dict reference, with B made non-zero so
    the update is really there; without the LoRA settings the export refuses (a plain checkpoint has no adapters)."""
    lora = LoraSettings(r=4, alpha=8.0, target_modules=["q_proj", "gate_proj", "in_proj_qkv", "in_proj_z"])
    model = build_model(tiny_qwen3_5_config())
    attach_lora(model, r=lora.r, alpha=lora.alpha, dropout=0.0, targets=lora.target_modules)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.1)
    save_pretrained(model, tmp_path, lora=lora)
    expected = merged_state_dict(model.state_dict(), alpha=lora.alpha, r=lora.r)
    got = load_hf_state_dict(tmp_path)
    assert_same_tensors(got, expected)
    base = "model.language_model.layers.3.self_attn.q_proj"
    assert not torch.equal(got[f"{base}.weight"], model.state_dict()[f"{base}.base_layer.weight"])
    with pytest.raises(ValueError, match="no LoRA settings were given"):
        save_pretrained(model, tmp_path / "refused")
    with pytest.raises(ValueError, match="not r=8"):
        save_pretrained(model, tmp_path / "refused", lora=LoraSettings(r=8, target_modules=lora.target_modules))


def test_plan_is_made_from_shapes_alone():
    """The layout of a model on the meta device (no data anywhere): what every rank computes before gathering."""
    model = meta_model(tiny_qwen3_5_moe_config(), resolve_backends("cpu"))
    steps = plan_export(model.state_dict(), tied_embeddings=False, dtype=torch.bfloat16)
    keys = [out.key for step in steps for out in step.outputs]
    assert keys[:2] == ["model.visual.patch_embed.proj.weight", "model.visual.patch_embed.proj.bias"]
    assert keys.index(f"{EXPERTS}.0.gate_proj.weight") + 1 == keys.index(f"{EXPERTS}.0.up_proj.weight")
    layout = plan_shards([out for step in steps for out in step.outputs], "1MB")
    assert layout.sharded and sorted(layout.weight_map()) == sorted(keys)
    assert layout.total_size == 2 * sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------ 2 ranks, sharded by FSDP2

BIG = {"hidden_size": 768, "num_hidden_layers": 12}
"""A dense model of 48.6M parameters: S = 93 MiB in bf16, 185 MiB as fp32 master weights; its largest tensor (the
embedding, 6 MiB in fp32) is far below a shard of S / 8."""


def big_bf16_checkpoint(directory: Path) -> Path:
    """Random bf16 tensors of the ``BIG`` model's shapes, written directly (no model is initialized)."""
    config = tiny_qwen3_5_config(**BIG)
    model = meta_model(config, resolve_backends("cpu"))
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(t.shape, generator=gen, dtype=torch.bfloat16) for k, t in model.state_dict().items()}
    config.save_pretrained(directory)
    save_file(state, directory / SINGLE_FILE, metadata={"format": "pt"})
    return directory


@pytest.fixture(scope="module")
def two_rank_exports(tmp_path_factory) -> dict[str, Path]:
    """One torchrun launch of ``export_worker.py`` (2 gloo ranks) over the dense, MoE and big checkpoints."""
    root = tmp_path_factory.mktemp("two_ranks")
    srcs = {f: bf16_checkpoint(root / f"{f}-src", f) for f in FAMILIES} | {"big": big_bf16_checkpoint(root / "big-src")}
    big_bytes = CheckpointIndex.open(srcs["big"]).total_bytes
    cases = [
        {"src": str(src), "out": str(root / name), "max_shard_size": "200KB" if name != "big" else big_bytes // 8,
         "measure": name == "big"}
        for name, src in srcs.items()
    ]  # fmt: skip
    env = launch_env() | {"EXPORT_CASES": json.dumps(cases)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER]
    done = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-6000:]
    return {**{name: root / name for name in srcs}, **{f"{n}-src": p for n, p in srcs.items()}}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_rank_export_equals_the_one_process_export(two_rank_exports, family, tmp_path):
    """The same files, byte for byte, whether the model was sharded over 2 ranks (gathered tensor by tensor) or
    whole in one process."""
    src = two_rank_exports[f"{family}-src"]
    one = save_pretrained(from_pretrained(src), tmp_path, source=CheckpointIndex.open(src), max_shard_size="200KB")
    two = two_rank_exports[family]
    names = sorted(p.name for p in two.iterdir())
    assert names == sorted(p.name for p in one.iterdir()) and len(names) > 3
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names if n.endswith(".safetensors"))
    assert json.loads((one / INDEX_FILE).read_text()) == json.loads((two / INDEX_FILE).read_text())


def test_two_rank_save_keeps_rank0_peak_to_a_shard(two_rank_exports):
    """Rank 0's host peak while saving the big model (fp32 master weights of size 2S, S its bf16 checkpoint) with
    shards of S/8 stays under 0.6 x 2S, a bound the old path (the full fp32 state dict on rank 0, measured in the same
    process) breaks: it needs the whole 2S. The export is still the checkpoint, bit for bit."""
    src, out = two_rank_exports["big-src"], two_rank_exports["big"]
    fp32_mib = 2 * CheckpointIndex.open(src).total_bytes / 2**20
    peaks = json.loads((out.parent / "big.peaks.json").read_text())
    bound = 0.6 * fp32_mib
    assert peaks["streamed_mib"] < bound < peaks["full_state_dict_mib"], (peaks, bound)
    assert len(json.loads((out / INDEX_FILE).read_text())["weight_map"]) == len(CheckpointIndex.open(src).entries)
    assert_same_tensors(load_hf_state_dict(out), load_hf_state_dict(src))


GENERATION_CONFIG = {"eos_token_id": [2050, 2048], "pad_token_id": 2048, "temperature": 0.6, "top_p": 0.95}
"""A base checkpoint's generation settings (stop tokens, sampling defaults), as Qwen's checkpoints ship them."""


@pytest.fixture(scope="module")
def lr0_runs(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """One optimizer step at learning rate 0 on 2 ranks from each family's bf16 checkpoint (sharded load, FSDP2
    step, streamed export), the two families side by side; ``family -> (input checkpoint, the run's final/)``."""
    from processors import load_tiny_processor, save_processor
    from vlm_sft.data.shapes import materialize_shapes

    tmp = tmp_path_factory.mktemp("lr0")
    materialize_shapes(tmp / "shapes", num_train=48, num_eval=0, progress=False)  # once, before the runs race to it
    started = {}
    for family in sorted(FAMILIES):
        base = bf16_checkpoint(tmp / family / "base", family)
        processor = load_tiny_processor()
        save_processor(base, processor, processor.tokenizer)
        (base / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
        overrides = {"model.name_or_path": str(base), "model.initializer_range": "none", "train.max_steps": 1}
        overrides |= {"train.lr": 0, "data.shapes.root": str(tmp / "shapes")}
        started[family] = (base, Background(tiny_run_args(tmp / family, **overrides), nproc=2))
    for _, run in started.values():
        run.wait(timeout=240)
    return {family: (base, tmp / family / "run" / "final") for family, (base, _) in started.items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_two_rank_run_at_lr_0_exports_its_bf16_checkpoint_bit_for_bit(lr0_runs, family):
    """The whole path a user's run takes: each rank reads its slices, trains a step that changes nothing, and the
    streamed export writes every tensor back in its own dtype (``mtp.*`` copied, MoE experts split per expert)."""
    base, final = lr0_runs[family]
    assert_same_tensors(load_hf_state_dict(final), load_hf_state_dict(base))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_export_serves_as_the_run_trained(lr0_runs, family):
    """A server reads ``final/``'s generation settings (the base's, copied: without them vLLM samples at its own
    defaults) and its chat template, whose default prompt is the run's non-thinking one although the base's is
    thinking (``renderers.served``)."""
    from processors import load_processor
    from renderers.served import default_thinking_mode

    base, final = lr0_runs[family]
    assert json.loads((final / "generation_config.json").read_text()) == GENERATION_CONFIG
    assert default_thinking_mode(load_processor(base).chat_template) is True
    assert default_thinking_mode(load_processor(final).chat_template) is False
