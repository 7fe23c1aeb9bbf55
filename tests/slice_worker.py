"""One rank of the sharded self-check test (``test_self_check.py``), launched by torchrun over gloo on 2 processes.

Every rank builds the same tiny model (dense, MoE, dense with LoRA over a bf16 base, MoE spread as expert parallelism
spreads it); rank 0 first builds the packing check's slice of the
unsharded model alone; then the model is ``fully_shard``-ed over both ranks and every rank builds the slice again
(its gathers are collectives). Rank 0 saves both slices' state dicts and flags to
``$SLICE_OUT/<name>.pt``; then every rank runs the trainer's ``run_packing_check`` on the sharded tiny run
(``$SLICE_RUN`` holds its overrides), and rank 0 saves the report to ``$SLICE_OUT/report.json``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vlm_sft.checkpoint import build
from vlm_sft.checks.self_check import run_packing_check
from vlm_sft.checks.slice import SliceShape, build_slice
from vlm_sft.config import load_config
from vlm_sft.data import build as data_build
from vlm_sft.model import build_model, tiny_qwen3_5_config, tiny_qwen3_5_moe_config
from vlm_sft.model.lora import attach_lora, store_frozen_in
from vlm_sft.parallel.env import DistEnv
from vlm_sft.parallel.mesh import build_mesh
from vlm_sft.parallel.parallelize import parallelize, shard_model

VOCAB = torch.tensor(sorted({0, 3, 1040, 1041, 2047, tiny_qwen3_5_config().text_config.pad_token_id}))
"""Ids on both ranks' halves of the vocabulary (2081 rows: rank 0 holds 0-1040), the pad id among them."""


def models():
    """(name, model, slice shape): shapes that narrow every way the slice can (experts, MLP channels)."""
    dense = tiny_qwen3_5_config()
    moe = tiny_qwen3_5_moe_config(num_experts=4)
    torch.manual_seed(0)
    yield "dense", build_model(dense, freeze_vision=False), SliceShape((1, 3), 1, mlp_width=48)
    torch.manual_seed(0)
    yield "moe", build_model(moe, freeze_vision=False), SliceShape((0, 3), 1, experts=3, top_k=2, mlp_width=24)
    torch.manual_seed(0)
    lora = build_model(dense)
    attach_lora(lora, r=4, alpha=8, dropout=0.0, targets=["q_proj", "in_proj_qkv", "down_proj"])
    store_frozen_in(lora, torch.bfloat16)
    yield "lora", lora, SliceShape((0, 3), 1, mlp_width=40)
    torch.manual_seed(0)
    yield "moe_ep", build_model(moe, freeze_vision=False), SliceShape((0, 3), 1, experts=3, top_k=2, mlp_width=24)


def expert_parallel(model, env):
    """``model`` spread as the trainer spreads it with ``train.ep_size = 2``: each rank holds 2 of the 4 experts of
    every layer (on the ``(edp, ep)`` mesh), the rest is FSDP2-sharded over both ranks."""
    return parallelize(model, build_mesh(env, ep_size=2))


def state(model) -> dict:
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
    }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env = DistEnv(rank=rank, world_size=dist.get_world_size(), local_rank=rank, device=torch.device("cpu"))
    out = Path(os.environ["SLICE_OUT"])
    for name, model, shape in models():
        alone = build_slice(copy.deepcopy(model), VOCAB, shape=shape) if rank == 0 else None
        spread = expert_parallel(model, env) if name == "moe_ep" else shard_model(model, env)
        sharded = build_slice(spread, VOCAB, env, shape)
        assert (sharded is None) == (rank != 0)
        if rank == 0:
            torch.save({"alone": state(alone), "sharded": state(sharded)}, out / f"{name}.pt")
    cfg = load_config("configs/debug.toml", json.loads(os.environ["SLICE_RUN"]))
    processor = data_build.build_processor(cfg)
    renderer = data_build.build_renderer(cfg, processor)
    source = data_build.load_sources(cfg).train
    model = shard_model(build.build_model(cfg, env.device), env)
    pad_id = int(processor.tokenizer.pad_token_id)
    report = run_packing_check(cfg, model=model, renderer=renderer, source=source, pad_id=pad_id, env=env, rows=1)
    assert (report is None) == (rank != 0)
    if rank == 0:
        (out / "report.json").write_text(json.dumps(report.to_dict()))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from vlm_sft.parallel.env import end_process

    end_process(0)  # as the CLI ends a process of a multi-process run: the interpreter's teardown can abort (gloo)
