#!/usr/bin/env bash
# The CPU check as one command, for a CPU the figures do not cover yet (AVX-512 with VNNI, AMX, another vendor):
# what issue 52's goals are measured with, in the order RESULTS.md reports them. From the repository root, in the venv:
#     bash benchmarks/cpu_check.sh [OUT_DIR]
#     PAIR_TARGET=q1.5b.gguf PAIR_DRAFT=q0.5b.gguf bash benchmarks/cpu_check.sh    # and a target/draft pair
# ~20 minutes on 2 cores for the default model, llama-bench's first build (~8 minutes) included; ~12 more for the pair.
# 1. the CPU (model, SIMD flags) and the kernel's tests, which take the paths this CPU has (AVX-512, AVX2 or plain C);
# 2. a verify of 2 / 5 / 9 positions in plain steps (verify_steps.py), on the default model and the pair's target;
# 3. on x86 with AVX2: what the AVX2 inner loop and its floor cost a half unit and position (avx2_unit_cost.c);
# 4. llama-bench, built once from the pinned llama.cpp (scripts/build_llama_server.py --tool llama-bench), and the
#    engines side by side against it on held-out prompts (engines.py): plain decoding and the chat's default (auto,
#    K measured), greedy and T=0.7.
# Every result lands in OUT_DIR, one text file a step; nothing else may load the machine meanwhile (the load average
# is in each file).
set -euo pipefail
OUT=${1:-cpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
{
    grep -m1 "model name" /proc/cpuinfo || uname -m
    echo "cores: $(nproc)"
    (grep -m1 -o -w -E "avx2|avx512f|avx512_vnni|avx512_bf16|avx_vnni|amx_tile|amx_int8" /proc/cpuinfo || true) | sort -u | tr '\n' ' '
    echo
    uptime
} | tee "$OUT/cpu.txt"
python -m pytest -q -n 0 tests/engine/test_gguf_kernel.py tests/engine/test_smallbatch.py tests/engine/test_row_kernels.py \
    > "$OUT/kernel-tests.txt" 2>&1 || echo "cpu_check: the kernel's tests FAILED on this CPU (see kernel-tests.txt)"
tail -3 "$OUT/kernel-tests.txt"
python benchmarks/verify_steps.py --sizes 1,2,5,9 --rounds 200 2>&1 | tee "$OUT/verify-default.txt"
if [[ -n "${PAIR_TARGET:-}" ]]; then
    python benchmarks/verify_steps.py --target "$PAIR_TARGET" --sizes 1,2,5,9 --rounds 40 2>&1 | tee "$OUT/verify-pair.txt"
fi
if grep -q -w avx2 /proc/cpuinfo 2>/dev/null; then
    for v in 0 4; do cc -O3 -march=native -DVARIANT=$v -o "$OUT/unit$v" benchmarks/avx2_unit_cost.c; done
    for run in 1 2; do "$OUT/unit0"; "$OUT/unit4"; done 2>&1 | tee "$OUT/avx2-unit-cost.txt"
    rm -f "$OUT/unit0" "$OUT/unit4"
fi
BENCH=$(python scripts/build_llama_server.py --tool llama-bench)
python benchmarks/engines.py --no-torch --modes off --lean-modes off,auto,suffix --measured-k --temperature 0,0.7 \
    --reps 2 --tokens 64 --llama-bench "$BENCH" 2>&1 | tee "$OUT/engines-default.txt"
if [[ -n "${PAIR_TARGET:-}" && -n "${PAIR_DRAFT:-}" ]]; then
    python benchmarks/engines.py --target "$PAIR_TARGET" --draft "$PAIR_DRAFT" --no-torch --modes off \
        --lean-modes off,auto,draft --measured-k --k 4 --temperature 0,0.7 --reps 1 --tokens 96 --llama-bench "$BENCH" \
        2>&1 | tee "$OUT/engines-pair.txt"
fi
echo "cpu_check: results in $OUT"
