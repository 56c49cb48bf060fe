#!/usr/bin/env bash
# The whole GPU check as one command, a few minutes on one GPU. From the repository root, in the venv:
#     bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests (tests/test_cuda.py, skipped where there is no CUDA) and the lean runner's tests;
# 2. a short `specchat bench --peers` on the default model on CUDA (bf16: every mode that runs, K=4, greedy and T=0.7);
# 3. the same for a target/draft pair if PAIR_TARGET and PAIR_DRAFT name local models (the largest pair that fits).
# Every result lands in OUT_DIR (report.md and results.json per bench).
set -euo pipefail
OUT=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
python - <<'PY' | tee "$OUT/device.txt"
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check: no CUDA device")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
python -m pytest -q tests/test_cuda.py tests/test_runner.py tests/test_head.py -x 2>&1 | tee "$OUT/tests.txt"
specchat bench --device cuda --draft-len 4 --temperature 0,0.7 --max-new-tokens 64 --repeat 1 --peers \
    --verify-samples 30 --out "$OUT/default"
if [[ -n "${PAIR_TARGET:-}" && -n "${PAIR_DRAFT:-}" ]]; then
    specchat bench --device cuda --target "$PAIR_TARGET" --draft "$PAIR_DRAFT" --modes off,draft,lookup \
        --draft-len 4,8 --temperature 0 --max-new-tokens 64 --repeat 1 --peers --verify-samples 0 --out "$OUT/pair"
fi
echo "gpu_check: done, results in $OUT"
