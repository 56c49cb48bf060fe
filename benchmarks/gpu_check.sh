#!/usr/bin/env bash
# The whole GPU check as one command, a few minutes on one GPU. From the repository root, in the venv:
#     bash benchmarks/gpu_check.sh [OUT_DIR]
# 1. the CUDA tests (tests/test_cuda.py, skipped where there is no CUDA) and the lean runner's tests;
# 2. a short `specchat bench --peers` on the default model on CUDA (bf16: every mode that runs, K=4, greedy and T=0.7);
# 3. the same for a target/draft pair if PAIR_TARGET and PAIR_DRAFT name local models (the largest pair that fits);
# 4. a real vLLM, where `python -c "import vllm"` works and VLLM_TARGET names a local HF model folder: one server
#    per speculative configuration (a draft model if VLLM_DRAFT is set, EAGLE-3 if VLLM_EAGLE3 names a local head,
#    n-gram, none), then `specchat bench --server` over all of them (steps checked against vLLM's metrics).
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
python -m pytest -q tests/test_cuda.py tests/engine/test_runner.py tests/engine/drafters/test_head.py -x 2>&1 | tee "$OUT/tests.txt"
specchat bench --device cuda --draft-len 4 --temperature 0,0.7 --max-new-tokens 64 --repeat 1 --peers \
    --verify-samples 30 --out "$OUT/default"
if [[ -n "${PAIR_TARGET:-}" && -n "${PAIR_DRAFT:-}" ]]; then
    specchat bench --device cuda --target "$PAIR_TARGET" --draft "$PAIR_DRAFT" --modes off,draft,lookup \
        --draft-len 4,8 --temperature 0 --max-new-tokens 64 --repeat 1 --peers --verify-samples 0 --out "$OUT/pair"
fi
if python -c "import vllm" 2>/dev/null && [[ -n "${VLLM_TARGET:-}" ]]; then
    declare -A SPEC=([plain]="" [ngram]='{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_max":4}')
    [[ -n "${VLLM_DRAFT:-}" ]] && SPEC[draft]="{\"model\":\"$VLLM_DRAFT\",\"num_speculative_tokens\":4}"
    [[ -n "${VLLM_EAGLE3:-}" ]] && SPEC[eagle3]="{\"method\":\"eagle3\",\"model\":\"$VLLM_EAGLE3\",\"num_speculative_tokens\":4}"
    port=8700; servers=(); pids=()
    for name in "${!SPEC[@]}"; do
        port=$((port + 1))
        args=(--model "$VLLM_TARGET" --host 127.0.0.1 --port "$port" --gpu-memory-utilization 0.2 --max-model-len 4096
              --per-request-spec-decode-metrics detailed)
        [[ -n "${SPEC[$name]}" ]] && args+=(--speculative-config "${SPEC[$name]}")
        python -m vllm.entrypoints.openai.api_server "${args[@]}" > "$OUT/vllm-$name.log" 2>&1 &
        pids+=($!); servers+=(--server "$name=http://127.0.0.1:$port")
    done
    for ((i = 0; i < 120; i++)); do  # until every server answers (loading takes a minute or two)
        ready=0
        for ((p = 8701; p <= port; p++)); do curl -sf "http://127.0.0.1:$p/health" > /dev/null && ready=$((ready + 1)); done
        [[ $ready -eq ${#pids[@]} ]] && break
        sleep 5
    done
    specchat bench "${servers[@]}" --max-new-tokens 128 --repeat 2 --out "$OUT/vllm" || echo "gpu_check: vLLM bench failed"
    kill "${pids[@]}" 2>/dev/null || true
else
    echo "gpu_check: vLLM check skipped (needs an importable vllm and VLLM_TARGET)" | tee "$OUT/vllm-skipped.txt"
fi
echo "gpu_check: done, results in $OUT"
