#!/usr/bin/env bash
# Every CPU benchmark, one after the other; each prints its table and writes bench/results/*.json, then
# bench/summarize.py collects the headline figures that bench/README.md's tables cite into bench/results/summary.json.
# About 105 minutes on 2 cores (ours vs transformers at 2 and 1 threads ~20, the default run x 3 seeds x 2
# launchers ~14, big-checkpoint load / save / resume ~12, the packing self-check calibration ~8, the data workers ~6,
# LoRA vs full ~5, context and expert parallelism ~4 each); bench_loss_memory.py alone needs ~12 GB of memory and ~10
# minutes (skip it with SKIP_LOSS_MEMORY=1). The GPU check is separate: bash bench/gpu.sh on a CUDA machine (its
# gpu_check/gpu_check.json is summarized too when present).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python}
"$PY" bench/bench_packing.py
"$PY" bench/bench_render.py
"$PY" bench/bench_data.py
"$PY" bench/bench_linear_attn.py
if [[ -z "${SKIP_LOSS_MEMORY:-}" ]]; then
  "$PY" bench/bench_loss_memory.py
fi
"$PY" bench/bench_train_throughput.py
"$PY" bench/bench_vs_transformers.py
"$PY" bench/bench_vs_transformers.py --threads 2 --out bench/results/vs_transformers_2threads.json
"$PY" bench/bench_vs_transformers.py --mode packer --out bench/results/vs_transformers_packer.json
"$PY" bench/bench_vs_transformers.py --mode packer --threads 2 --out bench/results/vs_transformers_packer_2threads.json
"$PY" bench/bench_lora.py
"$PY" bench/bench_moe.py
"$PY" bench/bench_cp.py
"$PY" bench/bench_ep.py
"$PY" bench/bench_load.py
"$PY" bench/bench_memory_plan.py
"$PY" bench/calibrate_packing_check.py
PYTHON="$PY" bash bench/default_run_seeds.sh
"$PY" bench/summarize.py
echo "tables: bench/README.md; figures: bench/results/*.json; headline figures: bench/results/summary.json"
