"""Entry point: ``accelerate launch vlm_sft/train.py [--config configs/x.toml] [--section.field value ...]``.

With no arguments it runs ``configs/debug.toml`` (tiny offline model, shapes dataset, CPU).
"""

from __future__ import annotations

import logging
import sys

from vlm_sft.config import ConfigError, load_config, split_config_arg

logger = logging.getLogger("vlm_sft.train")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        config_path, overrides = split_config_arg(argv)
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    logger.info("config loaded: model %s, data %s, %s packing", cfg.model.name_or_path, cfg.data.source, cfg.data.packing)
    print("vlm-sft: the training loop is not built yet (issue 6); the config above is valid.", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
