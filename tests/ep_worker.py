"""One rank of the expert-parallel routing test (``test_expert_parallel.py``), launched by torchrun over gloo.

Every rank builds the same ``Experts`` (4 experts) and the same tokens, splits the tokens between the ranks (rank r
computes tokens ``r::world``), runs them through expert parallelism over all ranks (ep = world size), and writes its
outputs, its input gradient and its experts' gradient (gathered whole; not FSDP2-sharded, so not divided by the world
size) to ``$EP_OUT/<case>-rank<R>.pt``, for routings that leave an expert, or a whole rank, without a token.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from vlm_sft.model import tiny_qwen3_5_moe_config
from vlm_sft.model.moe import Experts
from vlm_sft.parallel.collectives import full_tensor
from vlm_sft.parallel.expert_parallel import ExpertParallel, shard_experts, wrap_experts
from vlm_sft.parallel.mesh import EDP, EP

CASES = {  # name: the expert of every (token, k) slot, or "random"
    "random": "random",
    "expert3_idle": [[0, 1], [1, 2], [2, 0], [0, 1], [1, 0], [2, 1]],  # expert 3 (rank 1's second) gets nothing
    "rank1_idle": [[0, 1], [1, 0], [0, 1], [1, 0], [0, 1], [1, 0]],  # experts 2, 3 (all of rank 1's) get nothing
    "all_to_one": [[3, 3], [3, 3], [3, 3], [3, 3], [3, 3], [3, 3]],  # every slot to expert 3 (top-k repeats it)
}


def inputs(case: str, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    x_TD = torch.randn(6, cfg.hidden_size, generator=gen, dtype=torch.float64)
    if CASES[case] == "random":
        experts_TK = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)])
    else:
        experts_TK = torch.tensor(CASES[case])
    weights_TK = torch.rand(6, 2, generator=gen, dtype=torch.float64)
    return x_TD, experts_TK, weights_TK


def main() -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, size), mesh_dim_names=(EDP, EP))
    ep = ExpertParallel(mesh[EP], rank, size, mesh[EDP], size)
    cfg = tiny_qwen3_5_moe_config().text_config
    for case in CASES:
        torch.manual_seed(0)
        module = Experts(cfg).double()
        with torch.no_grad():
            for p in module.parameters():
                p.normal_(0.0, 0.1)
        shard_experts(module, ep)
        wrap_experts([module], ep)
        x_TD, experts_TK, weights_TK = inputs(case, cfg)
        mine = slice(rank, None, size)
        x_tD = x_TD[mine].clone().requires_grad_()
        w_tK = weights_TK[mine].clone().requires_grad_()
        y_tD = module(x_tD, experts_TK[mine], w_tK, impl="sorted")
        (y_tD * torch.arange(1, y_tD.numel() + 1, dtype=y_tD.dtype).view_as(y_tD)).sum().backward()
        grads = {}
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(module, name).grad.to_local()
            grads[name] = full_tensor(getattr(module, name).grad)  # the experts' gradient, whole (waited for)
            assert local.shape[0] == 2
        out = {"y": y_tD.detach(), "x_grad": x_tD.grad, "w_grad": w_tK.grad, **grads}
        torch.save(out, Path(os.environ["EP_OUT"]) / f"{case}-rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    from vlm_sft.parallel.env import end_process

    end_process(0)  # as the CLI ends a process of a multi-process run: the interpreter's teardown can abort (gloo)
