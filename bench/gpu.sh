#!/usr/bin/env bash
# The GPU check, in one command on one CUDA GPU (sized for an H200: under 8 minutes):
#   1. exactness: the CUDA kernel backends (flash-linear-attention GatedDeltaNet / conv / fused loss, flash-attn and
#      torch varlen attention) against the pure-torch ones, packed segments included (pytest -m gpu);
#   2. speed: training throughput and MFU of a randomly initialised Qwen3.5-0.8B-shaped model on 8k-token packs in
#      bf16 (bench/gpu_bench.py), packed vs padded, fast kernels vs pure torch.
# It installs nothing from the network: wheels carried in .whl/ (see bench/README.md) are installed offline into
# /tmp/site. Extra arguments go to gpu_bench.py, e.g. `bash bench/gpu.sh --steps 4`.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "note: no .whl/ folder: using the packages installed here (see bench/README.md for the wheels to carry)"
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - <<'EOF'
import importlib.util, sys
import torch, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible: bench/gpu.sh needs a GPU")
print("device:", torch.cuda.get_device_name(0))
for pkg in ("triton", "fla", "flash_attn", "causal_conv1d", "pytest"):
    print(f"  {pkg:<14} {'installed' if importlib.util.find_spec(pkg) else 'missing'}")
missing = [p for p in ("pytest",) if importlib.util.find_spec(p) is None]
if missing:
    sys.exit(f"missing {missing}: carry their wheels in .whl/")
EOF

echo "== 1/2 kernel exactness (pytest -m gpu) =="
mapfile -t GPU_TESTS < <(grep -l "mark.gpu" tests/*.py)
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider "${GPU_TESTS[@]}"

echo "== 2/2 training throughput and MFU, Qwen3.5-0.8B shape, 8k packs, bf16 =="
timeout 300 "$PY" bench/gpu_bench.py --backends auto,torch "$@"
