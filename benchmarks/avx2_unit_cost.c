/* What each part of the AVX2 interleaved-row kernel's inner loop costs (smallbatch.c's packed_rows256 on a Q4_K
   group, 16 rows x 1536 weights, its weights in L1): nanoseconds per half unit (8 rows x 32 weights) and position,
   best of 9, at 1 / 2 / 5 / 9 / 16 positions. One variant per build:

       cc -O3 -march=native -DVARIANT=0 -o /tmp/unit0 benchmarks/avx2_unit_cost.c && /tmp/unit0

   VARIANT 0  the kernel's loop: 8 broadcasts of x, 8 vpmaddubsw, 16-bit adds, one vpmaddwd, the float tail
           1  without the float tail (the 32-bit sums added up instead)
           2  x's broadcasts read from a buffer of them (a memory operand of vpmaddubsw) instead of vpbroadcastd
           3  2 without the float tail
           4  the floor: one x register for every product, no tail (what the multiplies and adds alone cost) */

#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef VARIANT
#define VARIANT 0
#endif
#define UNITS 48 /* 1536 / 32 */
#define UNIT_BYTES 288 /* 4 lines of nibbles (two halves of 32 bytes each) and the scales, as gguf_pack lays them */

static inline int four_bytes(const signed char *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

__attribute__((noinline)) static void group(const __m256i *xb, const unsigned char *w, const signed char *xq, const float *xd,
                                            const float *xs, const float *sc, const float *of, float *out, long S) {
    __m256 accs[2][16];
    for (int h = 0; h < 2; h++)
        for (long s = 0; s < S; s++) accs[h][s] = _mm256_setzero_ps();
    for (long u = 0; u < UNITS; u++) {
        const unsigned char *unit = w + u * UNIT_BYTES;
        for (int h = 0; h < 2; h++) {
            __m256 *acc = accs[h];
            __m256i ops[8]; /* 8 rows' weights 4o..4o+3 */
            for (int v = 0; v < 4; v++) {
                __m256i raw = _mm256_loadu_si256((const __m256i *)(unit + 64 * v + 32 * h));
                ops[v] = _mm256_and_si256(raw, _mm256_set1_epi8(15));
                ops[v + 4] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
            }
            __m256 scale = _mm256_loadu_ps(sc + 16 * u + 8 * h), offset = _mm256_loadu_ps(of + 16 * u + 8 * h);
            for (long s = 0; s < S; s++) {
                const signed char *x = xq + s * 1536 + u * 32;
                __m256i part = _mm256_setzero_si256();
#if VARIANT == 2 || VARIANT == 3
                for (int o = 0; o < 8; o++) part = _mm256_add_epi16(part, _mm256_maddubs_epi16(ops[o], _mm256_load_si256(xb + (s * UNITS + u) * 8 + o)));
#elif VARIANT == 4
                __m256i one = _mm256_set1_epi32(four_bytes(x));
                for (int o = 0; o < 8; o++) part = _mm256_add_epi16(part, _mm256_maddubs_epi16(ops[o], one));
#else
                for (int o = 0; o < 8; o++) part = _mm256_add_epi16(part, _mm256_maddubs_epi16(ops[o], _mm256_set1_epi32(four_bytes(x + 4 * o))));
#endif
                __m256i sum = _mm256_madd_epi16(part, _mm256_set1_epi16(1));
#if VARIANT == 0 || VARIANT == 2
                acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(xd[s * UNITS + u])), acc[s]);
                acc[s] = _mm256_fmadd_ps(offset, _mm256_set1_ps(xs[s * UNITS + u]), acc[s]);
#else
                acc[s] = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(acc[s]), sum));
#endif
            }
        }
    }
    for (int h = 0; h < 2; h++)
        for (long s = 0; s < S; s++) _mm256_storeu_ps(out + s * 16 + 8 * h, accs[h][s]);
}

int main(void) {
    unsigned char *w = aligned_alloc(64, UNITS * UNIT_BYTES);
    signed char *xq = aligned_alloc(64, 16 * 1536);
    __m256i *xb = aligned_alloc(64, sizeof(__m256i) * 16 * UNITS * 8);
    static float xd[16 * UNITS], xs[16 * UNITS], sc[16 * UNITS], of[16 * UNITS], out[256];
    for (int i = 0; i < UNITS * UNIT_BYTES; i++) w[i] = rand();
    for (int i = 0; i < 16 * 1536; i++) xq[i] = rand() % 255 - 127;
    for (int i = 0; i < 16 * UNITS * 8; i++) xb[i] = _mm256_set1_epi32(four_bytes(xq + 4 * i));
    for (int i = 0; i < 16 * UNITS; i++) xd[i] = 0.01f, xs[i] = 1.0f, sc[i] = of[i] = 0.1f;
    const long sizes[] = {1, 2, 5, 9, 16}, calls = 40000;
    for (int k = 0; k < 5; k++) {
        const long S = sizes[k];
        double best = 1e9;
        for (int t = 0; t < 9; t++) {
            double t0 = now();
            for (long i = 0; i < calls / S; i++) {
                __asm__ volatile("" ::"r"(w) : "memory");
                group(xb, w, xq, xd, xs, sc, of, out, S);
            }
            double ns = (now() - t0) / (calls / S) / (UNITS * 2 * S) * 1e9;
            best = ns < best ? ns : best;
        }
        printf("variant %d, %2ld positions: %.2f ns a half unit and position\n", VARIANT, S, best);
    }
    return out[0] == 12345.0f; /* keeps the results alive */
}
