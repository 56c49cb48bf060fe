#!/usr/bin/env bash
# A C compiler for the kernel's AVX-512 paths on a CPU without AVX-512: SIMDe (github.com/simd-everywhere/simde,
# header-only; not on PyPI) emulates AVX-512 F/BW/DQ/VL/VNNI, so the tests check those paths' bits on an AVX2-only
# machine. Their speed means nothing here. Use it as CC, serially (each build takes minutes; builds are cached by
# source and flags, so build once, then run the tests):
#
#     export SIMDE=/path/to/simde CC=$PWD/scripts/avx512_emulated_cc.sh
#     $CC -O3 -march=native -fopenmp -shared -fPIC -o /tmp/emulated.so specchat/engine/kernels/smallbatch.c
#     HF_HUB_OFFLINE=1 python -m pytest -n 0 tests/engine/test_gguf_kernel.py tests/engine/test_smallbatch.py \
#         tests/engine/test_row_kernels.py tests/engine/test_lean_engine.py tests/engine/test_gguf_model.py \
#         -k "not avx2_path and not without_simd and not tuned_for_amd and not without_f16c"
#
# (the four tests left out compile the kernel for other CPUs: minutes each, past their timeout.) It compiles a copy of
# the source that includes SIMDe with its native aliases and then defines the AVX-512 feature macros, at -O2 (-O3 takes
# tens of minutes; -O1 cannot inline the kernel).
set -euo pipefail
: "${SIMDE:?set SIMDE to a SIMDe checkout (the folder that holds simde/)}"
args=() copy=""
for a in "$@"; do
  if [[ "$a" == *.c ]]; then
    copy="$(mktemp --suffix=.c)"
    {
      printf '%s\n' '#include <string.h>' '#include <math.h>' '#include <stdlib.h>' '#include <omp.h>' \
        '#define SIMDE_ENABLE_NATIVE_ALIASES' '#include <immintrin.h>' '#include <simde/x86/avx512.h>' \
        '#define _mm512_mask3_fmadd_ps(a, b, c, k) simde_mm512_mask_mov_ps((c), (k), simde_mm512_fmadd_ps((a), (b), (c)))' \
        '#define __AVX512F__ 1' '#define __AVX512BW__ 1' '#define __AVX512DQ__ 1' '#define __AVX512VL__ 1' \
        '#define __AVX512VNNI__ 1' "#line 1 \"$(realpath "$a")\""  # (the same copy whatever path names it)
      cat "$a"
    } > "$copy"
    args+=("$copy")
  elif [[ "$a" == -O3 ]]; then
    args+=(-O2)
  else
    args+=("$a")
  fi
done
out=""
for ((i = 0; i + 1 < ${#args[@]}; i++)); do [[ "${args[i]}" == -o ]] && out="${args[i + 1]}"; done
key=()
for a in "${args[@]}"; do [[ "$a" != "$copy" && "$a" != "$out" ]] && key+=("$a"); done
cache="${TMPDIR:-/tmp}/avx512-emulated-cc/$(cat ${copy:+"$copy"} <(printf '%s ' "${key[@]}") | sha1sum | cut -c1-16)"
if [[ -n "$out" && -f "$cache" ]]; then
  cp "$cache" "$out"
else
  gcc -I "$SIMDE" -Wno-unused-function -Wno-psabi "${args[@]}"
  [[ -n "$out" ]] && mkdir -p "$(dirname "$cache")" && cp "$out" "$cache"
fi
[[ -n "$copy" ]] && rm -f "$copy"
true
