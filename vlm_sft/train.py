"""Entry point: ``accelerate launch vlm_sft/train.py [--config configs/x.toml] [--section.field value ...]``.

With no arguments it runs ``configs/debug.toml`` (tiny offline model, shapes dataset, CPU). Also runs under
``torchrun`` and as plain ``python vlm_sft/train.py`` (one process).
"""

from __future__ import annotations

import logging
import os
import sys

from vlm_sft.config import ConfigError, config_from_cli


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_cli(sys.argv[1:] if argv is None else argv)
    if cfg is None:
        return 2
    from vlm_sft.trainer.distributed import PeerFailure
    from vlm_sft.trainer.loop import train

    is_main = os.environ.get("RANK", "0") == "0"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        result = train(cfg)
    except ConfigError as err:  # settings that only fail against the machine or the data (e.g. bf16 without CUDA)
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except PeerFailure as err:  # another rank failed and printed why; rank 0 says where, the others stop quietly
        if is_main:
            print(err, file=sys.stderr)
        return 1
    if not is_main:  # every rank returns the same result; rank 0 reports it
        return 0
    if result.last_eval:
        accs = {k: round(v, 4) for k, v in result.last_eval.items() if k.startswith("eval_acc")}
        print(f"final eval: loss {result.last_eval['eval_loss']:.4f}, accuracy {accs}")
    print(
        f"finished {result.steps} steps in {result.wall_time_s:.1f} s ({result.real_tokens_per_s:.0f} real tokens/s); "
        f"checkpoint: {result.final_dir}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
