#!/usr/bin/env bash
# The GPU check: one command, on one CUDA GPU, under 8 minutes on an H200, that proves the first real run works.
#   1. kernel exactness: pytest -m gpu (the CUDA kernels against the pure-torch references, packed segments included);
#   2. the real trainer end to end, `python vlm_sft/train.py --config configs/gpu_check.toml`: a random model of the
#      full Qwen3.5-0.8B shape (24 layers) loaded from an HF checkpoint directory, bf16, activation checkpointing,
#      shapes data (images + text) in 8k-token packs, the packing self-check, eval, 30 steps with a checkpoint at
#      step 15; a second run resumes from that checkpoint and its losses are compared with the uninterrupted run's;
#      final/ is reloaded by our model and by transformers, which must agree on a probe;
#   3. speed: tokens/s, MFU and peak memory (bench/gpu_bench.py), packed vs padded, fastest vs pure-torch kernels.
# Figures: 7 files, gpu_check.json (every figure, the runs' metrics.jsonl records included), summary.txt (the table
# printed at the end) and one log per part, in $OUT/gpu_check/ when OUT is set, else bench/results/gpu_check/.
# Exit status 1 when a part failed.
#
#   bash bench/gpu.sh                  the check; wheels carried in .whl/ are installed offline first (bench/README.md)
#   bash bench/gpu.sh --cpu-smoke      the same parts on the CPU (2-layer model, float32, under 3 minutes; no
#                                      wheels installed), into a temporary folder unless --out is given
#   bash bench/gpu.sh --out DIR --keep-work --budget-s 420    options of bench/gpu_check.py (the orchestration);
#                                      any other option goes to bench/gpu_bench.py, e.g. --steps 4
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
SMOKE=0
for arg in "$@"; do [[ $arg == --cpu-smoke ]] && SMOKE=1; done

if [[ $SMOKE == 0 ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  [[ $SMOKE == 0 ]] && echo "note: no .whl/ folder: using the packages installed here (see bench/README.md for the wheels to carry)"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

if [[ $SMOKE == 0 ]]; then
  "$PY" - <<'EOF'
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible: bench/gpu.sh needs a GPU (bash bench/gpu.sh --cpu-smoke runs it on the CPU)")
needed = ("transformers", "pydantic", "datasets", "safetensors", "tokenizers", "accelerate", "PIL", "pytest")
missing = [p for p in needed if importlib.util.find_spec(p) is None]
if missing:
    sys.exit(f"missing {missing}: carry their wheels in .whl/ (see bench/README.md)")
if importlib.util.find_spec("fla") is None:
    print("note: flash-linear-attention is not installed: GatedDeltaNet runs on the pure-torch kernels")
EOF
fi

# bench/gpu_check.py keeps its own deadline (480 s; 170 s with --cpu-smoke) and writes its figures in every case;
# this limit is only a backstop, inside the device tool's 600 s per command.
exec timeout 570 "$PY" bench/gpu_check.py "$@"
