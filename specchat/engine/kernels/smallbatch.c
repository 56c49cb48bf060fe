/* y[S, N] = x[S, D] @ w[N, D]^T (+ b[N]) for 1 <= S <= 16 rows, reading every weight once for all S rows.
   Weights in float32 (smallbatch_linear), or, for drafts, whose weights need not be the target's to the last
   bit, in bfloat16 (smallbatch_linear_bf16: half the bytes to stream, each weight widened to float32 exactly)
   or int8 with a float32 scale per output row (smallbatch_linear_int8: a quarter of the bytes; y = scale[n] *
   sum x w). Products and sums are float32 in every case.

   On the CPU, PyTorch's GEMM for 4-16 rows costs 1.6-2.5x its one-row matrix-vector product (measured on the
   SmolLM2 matrices), while a decoder step is bound by streaming the weights from memory: a kernel that loads
   each weight once and multiplies it into all S rows costs 1.1-1.8 steps for S = 2-16 (llama.cpp's CPU
   path does the same). Every output is summed in the same order whatever S is, so a position's result does
   not depend on how many positions are fed with it.
   Portable C with GCC/Clang vector extensions (compiled with -O3 -march=native: AVX-512, AVX2, NEON...): the
   S accumulators stay in registers; the products are element-wise, so no reassociation (no -ffast-math).
   Threads: OpenMP over blocks of output rows, a call one parallel region (Teams, below); the process's OpenMP
   runtime is torch's own (same soname). */

#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));

static inline vec load(const float *p) {
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

enum { F32 = 4, BF16 = 2, INT8 = 1 }; /* weight kinds, by their bytes per weight */
typedef unsigned short hvec __attribute__((vector_size(LANES * sizeof(unsigned short))));
typedef unsigned int uvec __attribute__((vector_size(LANES * sizeof(unsigned int))));
typedef signed char cvec __attribute__((vector_size(LANES)));
typedef int ivec __attribute__((vector_size(LANES * sizeof(int))));

/* LANES int8 weights as float32: GCC scalarises the generic conversion of a char vector, so x86 says it */
static inline vec widen_int8(const signed char *p) {
    vec v;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#elif defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&v, &f, sizeof v);
#else
    cvec c;
    memcpy(&c, p, sizeof c);
    v = __builtin_convertvector(__builtin_convertvector(c, ivec), vec);
#endif
    return v;
}

/* LANES weights from element i on, as float32 (a bfloat16's bits are a float32's top half) */
static inline vec load_w(const void *w, long i, const int kind) {
    if (kind == F32) return load((const float *)w + i);
    if (kind == INT8) return widen_int8((const signed char *)w + i);
    hvec h;
    memcpy(&h, (const unsigned short *)w + i, sizeof h);
    uvec u = __builtin_convertvector(h, uvec) << 16;
    vec v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline float w_at(const void *w, long i, const int kind) {
    if (kind == F32) return ((const float *)w)[i];
    if (kind == INT8) return (float)((const signed char *)w)[i];
    unsigned int u = (unsigned int)((const unsigned short *)w)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum(vec v) {
    float s = 0.0f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
}

/* Output rows n0..n1-1 for S rows of x, R weight rows at a time: each x load serves R rows, each weight load
   S rows, and the R x S accumulators stay in registers. S, R and kind are constants after inlining; scale
   (int8 only) multiplies each output row's sum. */
static inline __attribute__((always_inline)) void rows(const float *restrict x, const void *restrict w,
                                                       const float *restrict scale, const float *restrict b,
                                                       float *restrict y, long n0, long n1, long N, long D,
                                                       const int S, const int R, const int kind) {
    long n = n0;
    for (; n + R <= n1; n += R) {
        vec acc[4][16] = {0}; /* only [R][S] are used */
        long d = 0;
        for (; d + LANES <= D; d += LANES) {
            vec wv[4];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                wv[r] = load_w(w, (n + r) * D + d, kind);
                __builtin_prefetch((const char *)w + ((n + R + r) * D + d) * kind); /* the next pass's rows */
            }
#pragma GCC unroll 16
            for (int s = 0; s < S; s++) {
                vec xv = load(x + s * D + d);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[r][s] += wv[r] * xv;
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
#pragma GCC unroll 16
            for (int s = 0; s < S; s++) {
                float sum = hsum(acc[r][s]);
                /* the tail past the last full vector: an explicit fused multiply-add, so it rounds the same
                   for every S (left to the compiler, GCC contracted it for some S and not others with
                   -march=znver2, and a row's result depended on how many rows came with it) */
                for (long t = d; t < D; t++) sum = __builtin_fmaf(w_at(w, (n + r) * D + t, kind), x[s * D + t], sum);
                /* one explicit fused multiply-add for int8: left to the compiler, whether it contracts the
                   scale and the bias into one (a rounding less) would depend on S */
                const float bias = b ? b[n + r] : 0.0f;
                y[s * N + n + r] = kind == INT8 ? __builtin_fmaf(sum, scale[n + r], bias) : sum + bias;
            }
        }
    }
    if (n < n1) rows(x, w, scale, b, y, n, n1, N, D, S, 1, kind); /* the last rows of the block, one at a time */
}

/* Weight rows per pass: as many as the registers hold accumulators for (32 vector registers with AVX-512,
   16 with AVX2 or NEON). */
#if LANES == 16
#define ROWS_FOR(S) ((S) <= 6 ? 4 : (S) <= 12 ? 2 : 1)
#define PASS 12 /* rows of x a pass over a block of weights takes at most (see block_rows) */
#else
#define ROWS_FOR(S) ((S) <= 3 ? 4 : (S) <= 6 ? 2 : 1)
#define PASS 16
#endif

#define BLOCK 32 /* output rows per work item */

/* A work item's block of weights times S rows of x: in one pass, or with AVX-512 and more than PASS rows, in two,
   the second reading the block again from the L2 cache. One pass of 13-16 rows takes one weight row at a time
   (ROWS_FOR), so every x load serves one product: 16 rows took 1.7x the time of 12 (AMD EPYC, a whole forward of
   the default model); as 12 + 4, 1.3x. With AVX2 the same split measured no better (7-13 rows slower, 16
   faster). A row's sums are the same whichever pass it is in. */
static inline __attribute__((always_inline)) void block_rows(const float *restrict x, const void *restrict w,
                                                             const float *restrict scale, const float *restrict b,
                                                             float *restrict y, long n0, long n1, long N, long D,
                                                             const int S, const int kind) {
    const int first = S < PASS ? S : PASS;
    rows(x, w, scale, b, y, n0, n1, N, D, first, ROWS_FOR(first), kind);
    if (S > PASS) rows(x + PASS * D, w, scale, b, y + PASS * N, n0, n1, N, D, S - PASS, ROWS_FOR(S - PASS), kind);
}

/* Teams: every kernel runs on the threads of one parallel region, its loops shared by orphaned `omp for` (on one
   thread where no region is open); an entry point called from Python opens the region. A forward is one region: a
   region's start costs ~1.2 us where a barrier costs ~0.3, and a small model's step had ~150 of them. */
#define CASE(S_)                                                                                   \
    case S_:                                                                                       \
        _Pragma("omp for schedule(static)")                                                        \
        for (long n0 = 0; n0 < N; n0 += BLOCK)                                                     \
            block_rows(x, w, scale, b, y, n0, n0 + BLOCK < N ? n0 + BLOCK : N, N, D, S_, KIND);    \
        return;

#define CASES                                                       \
    switch (S) {                                                    \
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) \
        CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16) \
    }

/* y [S, N] = x [S, D] @ w^T (+ b) for 1 <= S <= 16, on the calling team: w in float32, bfloat16, or int8 with a scale
   per row (kind F32, BF16, INT8) */
static void linear_team(const float *x, const void *w, int kind, const float *scale, const float *b, float *y, long S,
                        long N, long D) {
    if (kind == F32) {
#define KIND F32
        CASES
#undef KIND
    } else if (kind == BF16) {
#define KIND BF16
        CASES
#undef KIND
    } else {
#define KIND INT8
        CASES
#undef KIND
    }
}

static int linear_entry(const float *x, const void *w, int kind, const float *scale, const float *b, float *y, long S,
                        long N, long D, int threads) {
    if (S < 1 || S > 16) return -1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    linear_team(x, w, kind, scale, b, y, S, N, D);
    return 0;
}

int smallbatch_linear(const float *x, const float *w, const float *b, float *y, long S, long N, long D, int threads) {
    return linear_entry(x, w, F32, 0, b, y, S, N, D, threads);
}

int smallbatch_linear_bf16(const float *x, const unsigned short *w, const float *b, float *y, long S, long N, long D,
                           int threads) {
    return linear_entry(x, w, BF16, 0, b, y, S, N, D, threads);
}

int smallbatch_linear_int8(const float *x, const signed char *w, const float *scale, const float *b, float *y, long S,
                           long N, long D, int threads) {
    return linear_entry(x, w, INT8, scale, b, y, S, N, D, threads);
}

/* ------------------------------------------------------------------------------------------------------------
   One pre-norm decoder layer (Llama / Qwen2 / Qwen3 / Mistral) for 1 <= S <= 16 rows, batch 1:
   RMSNorm -> QKV (+ bias) -> [per-head q/k RMSNorm] -> RoPE -> K/V written into the layer's cache at positions
   past..past+S-1 -> causal attention over positions 0..past+s for row s -> o_proj -> residual -> RMSNorm ->
   gate/up -> SiLU(gate) * up -> down_proj -> residual. h [S, D] is updated in place.

   Why: in eager PyTorch a layer is ~20 small ops (each RMSNorm alone ~20-50 us on the reference CPU), which cost
   about 9 ms of a ~22 ms int8 draft step and of a ~40 ms float32 step of the default model; here they cost
   microseconds and the matrices stream as in smallbatch_linear*. As there, a row's result does not depend on S
   or on the thread count: every row is normalised, rotated and attended on its own, in a fixed order. */

#include <math.h>
#include <omp.h>
#include <stdlib.h>

struct layer {
    const float *ln1, *ln2, *q_norm, *k_norm; /* [D], [D], [hd] or null, [hd] or null */
    const void *w[4];                          /* qkv [(H + 2 Hkv) hd, D], o [D, H hd], gate_up [2 I, D], down [D, I] */
    const float *scale[4];                     /* int8 weights' scale per output row, else null */
    const float *bias[4];                      /* or null */
    int kind[4];                               /* F32, BF16, INT8 or GGUF_KIND + a ggml type (+ PACKED: interleaved) */
    long D, H, Hkv, hd, I;
    float eps, qk_eps, attn_scale;
    /* A GGUF matrix stacked from parts of their own types (a Q4_K_M file keeps V in Q6_K beside Q4_K Q and K), read
       in place: part p of matrix m is part_rows[m][p] rows (0: no such part; none: w[m] is the matrix) of ggml type
       part_type[m][p] (+ PACKED: gguf_pack's layout) at part_w[m][p]. */
    const void *part_w[4][3];
    long part_rows[4][3];
    int part_type[4][3];
};

#define GGUF_KIND 100 /* kind GGUF_KIND + ggml type: a GGUF file's blocks (gguf_linear, below) */
/* x [S, D] rounded to int8 blocks of 32 (quantize_rows) and what the kernels read of it: each block's scale and
   scale * sum(q), the integer sums per unit of 32 (16) for the interleaved rows, x + 128 and the scales 8 times
   for the file's layout on the 512-bit path. Sized for S <= 16 rows of up to D floats (rounded_alloc). */
struct rounded {
    signed char *xq;
    unsigned char *xu;
    float *x_d, *x_sums, *x_dexp;
    int *isums32, *isums16;
};

static int rounded_alloc(struct rounded *r, long S, long D);
static void rounded_free(struct rounded *r);
static int parts_read(int n, const int *types, const long *rows, long S, long D);
static void round_row(const float *x, long s, long D, int reads, struct rounded *r);
static void parts_team(const struct rounded *r, int n, const unsigned char *const *w, const int *types, const long *rows,
                       const float *bias, float *y, long ldy, long S, long D, int reference);

/* matrix m of L as GGUF parts (a matrix of one type is one part); n = 0: a float kind */
struct parts {
    int n;
    const unsigned char *w[3];
    int types[3];
    long rows[3];
};

static struct parts gguf_parts(const struct layer *L, int m, long N) {
    struct parts p = {0};
    if (L->part_rows[m][0]) {
        for (; p.n < 3 && L->part_rows[m][p.n]; p.n++)
            p.w[p.n] = L->part_w[m][p.n], p.types[p.n] = L->part_type[m][p.n], p.rows[p.n] = L->part_rows[m][p.n];
    } else if (L->kind[m] > GGUF_KIND) {
        p.n = 1, p.w[0] = L->w[m], p.types[0] = L->kind[m] - GGUF_KIND, p.rows[0] = N;
    }
    return p;
}

/* whether matrix m [N, D] of L is one the kernels take for S rows */
static int matrix_ok(const struct layer *L, int m, long S, long N, long D) {
    const struct parts p = gguf_parts(L, m, N);
    if (!p.n) return L->kind[m] == F32 || L->kind[m] == BF16 || L->kind[m] == INT8;
    long at = 0;
    for (int i = 0; i < p.n; i++) at += p.rows[i];
    return at == N && parts_read(p.n, p.types, p.rows, S, D) != 0;
}

/* y [S, N] = x [S, D] @ (matrix m of L)^T (+ its bias) in two steps: linear_round for each row (by the thread that
   wrote the row: a GGUF matrix's x rounded into r), then linear_rows on the whole team */
static void linear_round(const float *x, const struct layer *L, int m, long s, long N, long D, struct rounded *r) {
    const struct parts p = gguf_parts(L, m, N);
    if (p.n) round_row(x, s, D, parts_read(p.n, p.types, p.rows, 1, D), r);
}

static void linear_rows(const float *x, const struct layer *L, int m, float *y, long S, long N, long D, const struct rounded *r) {
    const struct parts p = gguf_parts(L, m, N);
    if (p.n)
        parts_team(r, p.n, p.w, p.types, p.rows, L->bias[m], y, N, S, D, 0);
    else
        linear_team(x, L->w[m], L->kind[m], L->scale[m], L->bias[m], y, S, N, D);
}

/* the sum of a vector's lanes by halves, for attention's dot products over a head (4 vectors of 64 floats), where a
   serial sum of the lanes (`hsum`, which the matrices keep: their sums end D / LANES vectors) would cost more than
   the products */
static inline float hsum_tree(vec v) {
#if defined(__AVX512F__)
    __m512 m;
    memcpy(&m, &v, sizeof v);
    return _mm512_reduce_add_ps(m);
#else
    float t[LANES];
    memcpy(t, &v, sizeof v);
#pragma GCC unroll 8
    for (int w = LANES / 2; w >= 1; w /= 2)
#pragma GCC unroll 8
        for (int l = 0; l < w; l++) t[l] += t[l + w];
    return t[0];
#endif
}

/* y = w * (x / sqrt(mean(x^2) + eps)), HF's LlamaRMSNorm in float32 */
static void rms_norm(const float *x, const float *w, float eps, float *y, long n) {
    vec acc[4] = {{0}}; /* the squares in 4 LANES-wide sums: one serial sum is a chain of dependent adds */
    long i = 0;
    for (; i + 4 * LANES <= n; i += 4 * LANES)
        for (int c = 0; c < 4; c++) acc[c] += load(x + i + c * LANES) * load(x + i + c * LANES);
    for (; i + LANES <= n; i += LANES) acc[0] += load(x + i) * load(x + i);
    float ss = hsum_tree((acc[0] + acc[1]) + (acc[2] + acc[3]));
    for (; i < n; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* RoPE in HF's rotate_half convention: x * cos + cat(-x2, x1) * sin, with sin_signed = cat(-sin1, sin2) */
static void rope(float *x, const float *cos, const float *sin_signed, long hd) {
    const long half = hd / 2;
    float r[512];
    for (long j = 0; j < hd; j++) r[j] = x[j] * cos[j] + x[j < half ? j + half : j - half] * sin_signed[j];
    memcpy(x, r, hd * sizeof(float));
}

/* A K/V cache holds float32 (kind F32) or float16 (F16: half the bytes a step after a long context re-reads; what
   llama.cpp keeps); a row of it is read widened to float32. */
enum { F16 = 3 };
static inline long kv_bytes(int kind) { return kind == F32 ? 4 : 2; }

static inline float half_to_float(unsigned short h);

/* LANES float16 values as float32 (exact) */
static inline vec load_f16(const unsigned short *p) {
    vec v;
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    memcpy(&v, &f, sizeof v);
#elif defined(__F16C__) && defined(__AVX__)
    __m256 f = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    memcpy(&v, &f, sizeof v);
#else
    for (int l = 0; l < LANES; l++) v[l] = half_to_float(p[l]);
#endif
    return v;
}

static inline vec load_kv(const void *p, long i, const int kind) {
    return kind == F32 ? load((const float *)p + i) : load_f16((const unsigned short *)p + i);
}

static inline float kv_at(const void *p, long i, const int kind) {
    return kind == F32 ? ((const float *)p)[i] : half_to_float(((const unsigned short *)p)[i]);
}

/* a . b[0..n-1], b a K/V cache's row of `kind` */
static inline __attribute__((always_inline)) float dot(const float *a, const void *b, long n, const int kind) {
    vec acc = {0};
    long i = 0;
    for (; i + LANES <= n; i += LANES) acc += load(a + i) * load_kv(b, i, kind);
    float s = hsum_tree(acc);
    for (; i < n; i++) s = __builtin_fmaf(a[i], kv_at(b, i, kind), s);
    return s;
}

/* a float32 as float16, rounded to nearest even (IEEE's conversion, torch's .half(): the same bits with F16C or
   without; past 65504 it is infinite, a NaN stays a quiet NaN) */
static inline unsigned short to_f16(float f) {
#if defined(__F16C__)
    return (unsigned short)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    unsigned int x;
    memcpy(&x, &f, sizeof x);
    const unsigned int sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
    if (a < 0x38800000u) { /* below half's smallest normal: a multiple of 2^-24 (exact scaling), rounded to even */
        float v;
        memcpy(&v, &a, sizeof v);
        return (unsigned short)(sign | (unsigned int)nearbyintf(v * 16777216.0f));
    }
    return (unsigned short)(sign | ((a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u) >> 13));
#endif
}

/* n floats into a K/V cache's row of `kind` (F32: copied; F16: rounded) */
static void store_kv(void *dst, const float *src, long n, int kind) {
    if (kind == F32) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    unsigned short *d = dst;
    for (long i = 0; i < n; i++) d[i] = to_f16(src[i]);
}

static inline vec vselect(ivec mask, vec a, vec b) { /* a where mask is all ones, else b */
    ivec ia, ib;
    memcpy(&ia, &a, sizeof a);
    memcpy(&ib, &b, sizeof b);
    ia = (ia & mask) | (ib & ~mask);
    memcpy(&a, &ia, sizeof a);
    return a;
}

/* e^x for LANES floats at once (Cephes' expf: x = k ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial, 2^k by the
   exponent bits; within 2 ulp of expf for x in [-87, 88], clamped outside): libm's expf one float at a time was
   most of a long context's attention (an exponential per score) */
static inline vec vexp(vec x) {
    const vec zero = {0}, hi = zero + 88.3762626647949f, lo = zero - 87.3365447504019f;
    x = vselect(x > hi, hi, x);
    x = vselect(x < lo, lo, x);
    const vec magic = zero + 12582912.0f; /* 1.5 * 2^23: adding it rounds to the nearest integer */
    const vec k = (x * 1.44269504088896341f + magic) - magic;
    const vec r = x - k * 0.693359375f - k * -2.12194440e-4f;
    vec p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* e^x for one float, the same arithmetic (the tails past the last full vector) */
static inline float sexp(float x) {
    vec v = {0};
    v[0] = x;
    return vexp(v)[0];
}

/* keys ahead that attention's passes prefetch: after a long context the keys and values come from memory, and the
   hardware's prefetchers left those passes waiting on them */
#define KV_AHEAD 16
#define HEADS (LANES == 16 ? 4 : 2) /* query rows a pass over the values takes: 4 vectors of sums each, in registers */

/* out[m, hd] = p[m, :n[m]] V / sum[m] for m <= HEADS query rows (p's rows `stride` apart, n nondecreasing) in one pass
   over the values, each row's sums in the order of a pass of its own (key after key): several rows' independent sums
   hide the latency of one row's */
static inline __attribute__((always_inline)) void attend_values(const float *p, long stride, const long *n, const void *v,
                                                                long hd, const float *sum, float *out, const long m,
                                                                const int kind) {
    long d = 0;
    for (; d + 4 * LANES <= hd; d += 4 * LANES) { /* 4 vectors of each row's output stay in registers over all keys */
        vec acc[HEADS][4] = {{{0}}};
        long j = 0;
        for (; j < n[0]; j++) { /* keys every row attends to */
            vec vj[4];
            for (int c = 0; c < 4; c++) __builtin_prefetch((const char *)v + ((j + KV_AHEAD) * hd + d + c * LANES) * kv_bytes(kind), 0, 3);
            for (int c = 0; c < 4; c++) vj[c] = load_kv(v, j * hd + d + c * LANES, kind);
#pragma GCC unroll 4
            for (long a = 0; a < m; a++)
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++) acc[a][c] += p[a * stride + j] * vj[c];
        }
        for (; j < n[m - 1]; j++) { /* the later positions' last keys */
            vec vj[4];
            for (int c = 0; c < 4; c++) vj[c] = load_kv(v, j * hd + d + c * LANES, kind);
            for (long a = 0; a < m; a++)
                if (j < n[a])
                    for (int c = 0; c < 4; c++) acc[a][c] += p[a * stride + j] * vj[c];
        }
        for (long a = 0; a < m; a++)
            for (int c = 0; c < 4; c++) {
                const vec y = acc[a][c] / sum[a];
                memcpy(out + a * hd + d + c * LANES, &y, sizeof y);
            }
    }
    for (; d < hd; d++)
        for (long a = 0; a < m; a++) {
            float acc = 0.0f;
            for (long j = 0; j < n[a]; j++) acc = __builtin_fmaf(p[a * stride + j], kv_at(v, j * hd + d, kind), acc);
            out[a * hd + d] = acc / sum[a];
        }
}

/* The lane sums of LANES vectors x[0..LANES-1], sum l (of x[bitrev(l)]) in lane l, each by hsum_tree's pairs (lane i
   + lane i + w for w = LANES / 2 .. 1). A level adds two vectors' halves into one: segment m of w lanes of the result
   is vector (m % 2)'s segment m / 2 of 2w lanes, its first half plus its second; the masks below are those lanes
   (the second vector's numbered from LANES). LANES - 1 additions and twice as many shuffles for LANES sums, where
   sums of their own take LANES log2(LANES) of each. */
#if LANES == 16
#define LEVELS 4
static const ivec SUM_LO[LEVELS] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
    {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}, {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}};
static const ivec SUM_HI[LEVELS] = {
    {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31}, {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31},
    {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31}, {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31}};
static const unsigned char BITREV[LANES] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
#define LEVELS 3
static const ivec SUM_LO[LEVELS] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 8, 9, 4, 5, 12, 13}, {0, 8, 2, 10, 4, 12, 6, 14}};
static const ivec SUM_HI[LEVELS] = {{4, 5, 6, 7, 12, 13, 14, 15}, {2, 3, 10, 11, 6, 7, 14, 15}, {1, 9, 3, 11, 5, 13, 7, 15}};
static const unsigned char BITREV[LANES] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif

static inline __attribute__((always_inline)) vec lane_sums(vec *x) {
#pragma GCC unroll 4
    for (int level = 0, count = LANES; level < LEVELS; level++, count /= 2)
#pragma GCC unroll 8
        for (int i = 0; i < count / 2; i++)
            x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], SUM_LO[level]) + __builtin_shuffle(x[2 * i], x[2 * i + 1], SUM_HI[level]);
    return x[0];
}

/* p[a * stride + j] = scale * q_a . k_j for j < n[a], the same bits as dot's, LANES keys at a time: their rows widened
   once into kw [LANES, hd] for all r query rows (zeros past the last key), each row's LANES sums of products then
   reduced together by lane_sums. hd a multiple of LANES. */
static inline __attribute__((always_inline)) void scores(const float *q, long r, const long *n, const void *k, long hd,
                                                         float scale, float *p, long stride, float *kw, const int kind) {
    for (long j0 = 0, first = 0; j0 < stride; j0 += LANES) {
        const long keys = stride - j0 < LANES ? stride - j0 : LANES;
        for (long t = 0; t < LANES; t++)
            for (long i = 0; i < hd; i += LANES) {
                __builtin_prefetch((const char *)k + ((j0 + t + KV_AHEAD) * hd + i) * kv_bytes(kind), 0, 3);
                const vec x = t < keys ? load_kv(k, (j0 + t) * hd + i, kind) : (vec){0};
                memcpy(kw + t * hd + i, &x, sizeof x);
            }
        while (n[first] <= j0) first++;
        for (long a = first; a < r; a++) {
            vec acc[LANES] = {{0}}; /* slot l: key bitrev(l) */
            for (long i = 0; i < hd; i += LANES) {
                const vec qi = load(q + a * hd + i);
#pragma GCC unroll 16
                for (int l = 0; l < LANES; l++) acc[l] += qi * load(kw + BITREV[l] * hd + i);
            }
            const vec y = scale * lane_sums(acc);
            if (n[a] - j0 >= LANES)
                memcpy(p + a * stride + j0, &y, sizeof y);
            else
                for (long t = 0; t < n[a] - j0; t++) p[a * stride + j0 + t] = y[t];
        }
    }
}

/* out[r, hd] = softmax(scale * q_i . K[0..n[i]-1]) V for r query rows i that share one KV head (rows of stride hd,
   n nondecreasing: the heads of a group at one or more positions; K and V float32 or float16, `kind`): each key and
   value is read once for all r. p: r * (n[r - 1] + 1) + LANES * hd floats of scratch. Row i's sums run in the same
   order whatever rows it comes with. */
static inline __attribute__((always_inline)) void attend_kind(const float *q, long r, const long *n, const void *k,
                                                              const void *v, long hd, float scale, float *p, float *out,
                                                              const int kind) {
    const long stride = n[r - 1];
    float *sum = p + r * stride;
    if (hd % LANES == 0)
        scores(q, r, n, k, hd, scale, p, stride, p + r * (stride + 1), kind);
    else
        for (long j = 0, first = 0; j < stride; j++) {
            while (n[first] <= j) first++;
            for (long a = first; a < r; a++) p[a * stride + j] = scale * dot(q + a * hd, (const char *)k + j * hd * kv_bytes(kind), hd, kind);
        }
    for (long a = 0; a < r; a++) {
        float *pa = p + a * stride, m = -INFINITY;
        const long na = n[a];
        long j = 0;
        if (na >= LANES) { /* the largest score in LANES lanes (a serial max is a chain of dependent steps) */
            vec big = load(pa);
            for (j = LANES; j + LANES <= na; j += LANES) {
                const vec v = load(pa + j);
                big = vselect(v > big, v, big);
            }
            for (int l = 0; l < LANES; l++) m = big[l] > m ? big[l] : m;
        }
        for (; j < na; j++) m = pa[j] > m ? pa[j] : m;
        vec total = {0};
        for (j = 0; j + LANES <= na; j += LANES) {
            vec e = vexp(load(pa + j) - m);
            memcpy(pa + j, &e, sizeof e);
            total += e;
        }
        float t = hsum_tree(total);
        for (; j < na; j++) t += pa[j] = sexp(pa[j] - m);
        sum[a] = t;
    }
    for (long a = 0; a < r; a += HEADS) {
        const long m = r - a < HEADS ? r - a : HEADS;
        switch (m) { /* a constant count of rows keeps their sums in registers */
        case 1: attend_values(p + a * stride, stride, n + a, v, hd, sum + a, out + a * hd, 1, kind); break;
        case 2: attend_values(p + a * stride, stride, n + a, v, hd, sum + a, out + a * hd, 2, kind); break;
#if HEADS > 2
        case 3: attend_values(p + a * stride, stride, n + a, v, hd, sum + a, out + a * hd, 3, kind); break;
        case 4: attend_values(p + a * stride, stride, n + a, v, hd, sum + a, out + a * hd, 4, kind); break;
#endif
        }
    }
}

static void attend(const float *q, long r, const long *n, const void *k, const void *v, long hd, float scale, float *p,
                   float *out, int kind) {
    if (kind == F16)
        attend_kind(q, r, n, k, v, hd, scale, p, out, F16);
    else
        attend_kind(q, r, n, k, v, hd, scale, p, out, F32);
}

/* SiLU(gate) * up over n floats */
static void silu_mul(const float *gate, const float *up, float *y, long n) {
    long i = 0;
    for (; i + LANES <= n; i += LANES) {
        const vec g = load(gate + i), e = g / (1.0f + vexp(-g)) * load(up + i);
        memcpy(y + i, &e, sizeof e);
    }
    for (; i < n; i++) y[i] = gate[i] / (1.0f + sexp(-gate[i])) * up[i];
}

/* A call's memory, taken before its parallel region (nothing in a region may fail): the layers' activations and x
   rounded for their GGUF matrices, sized for the largest layer; each thread's attention scratch is its own */
struct work {
    float *x, *qkv, *att, *gu, *act, *y; /* [S, D], [S, Q], [S, H hd], [S, 2 I], [S, I], [S, D] */
    struct rounded r;
    long R, keys, hd; /* attention: an item's query rows, the keys a row attends to, a head's size, at most */
    int threads;  /* asked for: what attention's runs are cut for (a smaller team only balances worse) */
    int failed;   /* a thread got no attention scratch: the call returns -1 */
};

static void work_free(struct work *w) {
    free(w->x), free(w->qkv), free(w->att), free(w->gu), free(w->act), free(w->y);
    rounded_free(&w->r);
}

/* attention's work items: a KV head at a run of positions, whose rows share one pass over the head's keys and values
   (a verify's positions read them once, not once each), in any order; the runs as long as leaves two items a
   thread (one would leave 3 KV heads on 2 threads at 2:1) */
static long attention_run(const struct layer *L, long S, int threads) {
    const long want = threads > 1 ? (2 * threads + L->Hkv - 1) / L->Hkv : 1, runs = want < S ? want : S;
    return (S + runs - 1) / runs;
}

/* n layers and the head (either may be absent) checked for S rows, and their memory taken; -1: a shape the kernels
   do not take, or no memory */
static int work_alloc(struct work *w, const struct layer *const *L, int n, const struct layer *head, long headN, long S,
                      long past, int threads) {
    memset(w, 0, sizeof *w);
    w->threads = threads;
    if (S < 1 || S > 16) return -1;
    long D = head ? head->D : L[0]->D, Q = 0, A = 0, I = 0, X = D;
    for (int i = 0; i < n; i++) {
        const struct layer *l = L[i];
        const long q = (l->H + 2 * l->Hkv) * l->hd;
        if (l->D != D || l->hd > 512 || l->H % l->Hkv || !matrix_ok(l, 0, S, q, D) || !matrix_ok(l, 1, S, D, l->H * l->hd)
            || !matrix_ok(l, 2, S, 2 * l->I, D) || !matrix_ok(l, 3, S, D, l->I)) return -1;
        Q = q > Q ? q : Q, A = l->H * l->hd > A ? l->H * l->hd : A, I = l->I > I ? l->I : I;
        const long R = attention_run(l, S, threads) * (l->H / l->Hkv);
        w->R = R > w->R ? R : w->R, w->hd = l->hd > w->hd ? l->hd : w->hd;
        X = A > X ? A : X, X = I > X ? I : X;
    }
    if (head && !matrix_ok(head, 0, S, headN, D)) return -1;
    w->keys = past + S;
    w->x = malloc(sizeof(float) * S * D), w->y = malloc(sizeof(float) * S * D);
    w->qkv = malloc(sizeof(float) * S * (Q + 1)), w->att = malloc(sizeof(float) * S * (A + 1));
    w->gu = malloc(sizeof(float) * S * (2 * I + 1)), w->act = malloc(sizeof(float) * S * (I + 1));
    if (rounded_alloc(&w->r, S, X)) w->r = (struct rounded){0}; /* (freed) */
    if (!w->r.xq || !w->x || !w->y || !w->qkv || !w->att || !w->gu || !w->act) {
        work_free(w);
        return -1;
    }
    return 0;
}

/* One layer on the calling team: h [S, D] in place; cos, sin_signed [S, hd] for positions past..; keys, values
   [Hkv, capacity, hd], float32 or float16 (`kv`: F32 or F16; K and V rounded to it as they are written, and read
   back from it, the position's own included). p, n: this thread's attention scratch (null: it has none). */
static void layer_team(const struct layer *L, float *h, long S, const float *cos, const float *sin_signed, void *keys,
                       void *values, long capacity, long past, int kv, struct work *w, float *p, long *n,
                       const float *pending) {
    const long D = L->D, H = L->H, Hkv = L->Hkv, hd = L->hd, I = L->I, n_rep = H / Hkv, Q = (H + 2 * Hkv) * hd;
    char *K = keys, *V = values; /* rows of hd * kv_bytes(kv) bytes */
    const long kb = kv_bytes(kv);
    float *x = w->x, *qkv = w->qkv, *att = w->att, *gu = w->gu, *act = w->act, *y = w->y;

    /* a region's threads meet at the end of each loop: 10 times a layer; the rows' own steps (norms, RoPE, rounding)
       shared by rows, which a verify has several of */
#pragma omp for schedule(static)
    for (long s = 0; s < S; s++) {
        if (pending)
            for (long i = s * D; i < (s + 1) * D; i++) h[i] += pending[i];
        rms_norm(h + s * D, L->ln1, L->eps, x + s * D, D);
        linear_round(x, L, 0, s, Q, D, &w->r);
    }
    linear_rows(x, L, 0, qkv, S, Q, D, &w->r);
#pragma omp for schedule(static)
    for (long s = 0; s < S; s++) {
        float *row = qkv + s * Q; /* q heads, k heads, v heads */
        for (long j = 0; j < H + Hkv; j++) {
            float *head = row + j * hd;
            const float *norm = j < H ? L->q_norm : L->k_norm;
            if (norm) rms_norm(head, norm, L->qk_eps, head, hd);
            rope(head, cos + s * hd, sin_signed + s * hd, hd);
        }
        for (long g = 0; g < Hkv; g++) {
            store_kv(K + (g * capacity + past + s) * hd * kb, row + (H + g) * hd, hd, kv);
            store_kv(V + (g * capacity + past + s) * hd * kb, row + (H + Hkv + g) * hd, hd, kv);
        }
    }
    /* row s of the query heads sharing KV head g attends to positions 0..past+s */
    const long run = attention_run(L, S, w->threads), items = Hkv * ((S + run - 1) / run);
#pragma omp for schedule(static)
    for (long it = 0; it < items; it++) {
        if (!p || !n) continue;
        const long g = it % Hkv, s0 = it / Hkv * run, s1 = s0 + run < S ? s0 + run : S, r = (s1 - s0) * n_rep;
        float *q = p + w->R * (w->keys + 1) + LANES * hd, *o = q + w->R * hd; /* after the scores and kw */
        for (long s = s0; s < s1; s++)
            for (long a = 0; a < n_rep; a++) {
                const long i = (s - s0) * n_rep + a;
                memcpy(q + i * hd, qkv + s * Q + (g * n_rep + a) * hd, hd * sizeof(float));
                n[i] = past + s + 1;
            }
        attend(q, r, n, K + g * capacity * hd * kb, V + g * capacity * hd * kb, hd, L->attn_scale, p, o, kv);
        for (long s = s0; s < s1; s++)
            memcpy(att + (s * H + g * n_rep) * hd, o + (s - s0) * n_rep * hd, n_rep * hd * sizeof(float));
    }
#pragma omp for schedule(static)
    for (long s = 0; s < S; s++) linear_round(att, L, 1, s, D, H * hd, &w->r);
    linear_rows(att, L, 1, y, S, D, H * hd, &w->r);
#pragma omp for schedule(static)
    for (long s = 0; s < S; s++) {
        for (long i = s * D; i < (s + 1) * D; i++) h[i] += y[i];
        rms_norm(h + s * D, L->ln2, L->eps, x + s * D, D);
        linear_round(x, L, 2, s, 2 * I, D, &w->r);
    }
    linear_rows(x, L, 2, gu, S, 2 * I, D, &w->r);
#pragma omp for schedule(static)
    for (long s = 0; s < S; s++) {
        silu_mul(gu + s * 2 * I, gu + s * 2 * I + I, act + s * I, I);
        linear_round(act, L, 3, s, D, I, &w->r);
    }
    linear_rows(act, L, 3, y, S, D, I, &w->r); /* y: the residual the next layer adds to h first (pending) */
}

/* The forward's one region: the S rows `rows` copied into h [S, D] (rows: null, h as it is), layers L[0..n-1] on it
   (cos, sin_signed from position past), then the final norm and head (null: none) of its last `keep` rows into
   logits [keep, N]. Every entry point below is this with parts left out. */
static int forward(const struct layer *const *L, int n, const float *const *rows, float *h, long S, const float *cos,
                   const float *sin_signed, void *const *keys, void *const *values, const long *capacity, long past,
                   const struct layer *head, long N, long keep, float *logits, int threads, int kv) {
    struct work w;
    if ((kv != F32 && kv != F16) || (!n && !head) || (head && (keep < 1 || keep > S))) return -1;
    for (int i = 0; i < n; i++)
        if (past + S > capacity[i]) return -1;
    if (work_alloc(&w, L, n, head, N, S, past, threads)) return -1;
    const long D = head ? head->D : L[0]->D;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *p = n ? malloc(sizeof(float) * (w.R * (w.keys + 1) + (LANES + 2 * w.R) * w.hd)) : NULL;
        long *m = n ? malloc(sizeof(long) * w.R) : NULL;
        if (n && (!p || !m)) {
#pragma omp atomic write
            w.failed = 1;
        }
        if (rows) {
#pragma omp for schedule(static)
            for (long s = 0; s < S; s++) memcpy(h + s * D, rows[s], D * sizeof(float));
        }
        for (int i = 0; i < n; i++)
            layer_team(L[i], h, S, cos, sin_signed, keys[i], values[i], capacity[i], past, kv, &w, p, m, i ? w.y : NULL);
#pragma omp for schedule(static)
        for (long s = 0; s < S; s++) {
            if (n)
                for (long i = s * D; i < (s + 1) * D; i++) h[i] += w.y[i]; /* the last layer's residual */
            if (head && s >= S - keep) {
                const long k = s - (S - keep); /* the head's row */
                rms_norm(h + s * D, head->ln1, head->eps, w.x + k * D, D);
                linear_round(w.x, head, 0, k, N, D, &w.r);
            }
        }
        if (head) linear_rows(w.x, head, 0, logits, keep, N, D, &w.r);
        free(p), free(m);
    }
    const int failed = w.failed;
    work_free(&w);
    return failed ? -1 : 0;
}

/* one layer: h [S, D] in place, cos and sin_signed [S, hd] for positions past.., keys and values [Hkv, capacity, hd].
   0, or -1 for a shape it does not take or memory it could not get (the caller checks the shapes first:
   smallbatch.layer_weights) */
int smallbatch_layer(const struct layer *L, float *h, long S, const float *cos, const float *sin_signed, void *keys,
                     void *values, long capacity, long past, int threads, int kv) {
    return forward(&L, 1, NULL, h, S, cos, sin_signed, &keys, &values, &capacity, past, NULL, 0, 0, NULL, threads, kv);
}

/* layers L[0..n-1] in turn on h, layer i's K/V in keys[i], values[i] (capacity[i] positions): a forward is one call
   (from Python, a call a layer costs ~10 us of a small model's ~70 us layer) */
int smallbatch_layers(const struct layer *const *L, int n, float *h, long S, const float *cos, const float *sin_signed,
                      void *const *keys, void *const *values, const long *capacity, long past, int threads, int kv) {
    if (n < 1) return -1;
    return forward(L, n, NULL, h, S, cos, sin_signed, keys, values, capacity, past, NULL, 0, 0, NULL, threads, kv);
}

/* logits y [S, N] of h [S, D], 1 <= S <= 16: the final RMSNorm and the LM head, described as a struct layer whose ln1
   and eps are the norm's and whose matrix 0 is the head (any kind linear_rows takes). Each row on its own, as above. */
int smallbatch_logits(const struct layer *head, const float *h, long S, long N, float *y, int threads) {
    return forward(NULL, 0, NULL, (float *)h, S, NULL, NULL, NULL, NULL, NULL, 0, head, N, S, y, threads, F32);
}

/* A whole forward in one call: the S embedding rows rows[s] [D] copied into h [S, D], layers L[0..n-1] on it (cos,
   sin_signed: the tables from position 0), h left holding the last layer's output, and the logits [keep, N] of its last
   `keep` rows. The same arithmetic as those calls one by one; from Python each step between them was a few library
   calls that found their code and data evicted by the weights' stream. */
int smallbatch_forward(const struct layer *const *L, int n, const float *const *rows, float *h, long S,
                       const float *cos, const float *sin_signed, void *const *keys, void *const *values,
                       const long *capacity, long past, const struct layer *head, long N, long keep, float *logits,
                       int threads, int kv) {
    if (n < 1) return -1;
    const long hd = L[0]->hd;
    return forward(L, n, rows, h, S, cos + past * hd, sin_signed + past * hd, keys, values, capacity, past, head, N, keep,
                   logits, threads, kv);
}

/* ------------------------------------------------------------------------------------------------------------
   GGUF's own blocks (issue 52): y[S, N] = x[S, D] @ w[N, D]^T where w's rows are blocks exactly as the file stores
   them (read in place from the memory-mapped file: no float32 copy): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (32 weights a
   block) and the K-quants Q4_K, Q5_K, Q6_K (256 weights a super-block, a scale per 32 or 16 of them). Each row of x is
   first rounded to int8 in blocks of 32 with a scale per block (amax / 127, llama.cpp's q8_0). Every weight type is
   then read as blocks of 32: 32 integers q (signed, or unsigned where the type has an offset), a float scale for
   weights 0-15 and one for 16-31 (they differ only in Q6_K), and an offset: w = scale * q + offset. A unit's scales
   (a super-block, or 8 blocks) are read once; each weight block is decoded once into 32 bytes for as many positions
   as the registers hold (up to 10) and multiplied into each of their int8 blocks: lane l holds the integer sum of
   products 4l..4l+3 (AVX-512 VNNI dpbusd on two blocks at once, 16 lanes; AVX-VNNI dpbusd or AVX2 maddubs + madd on
   one, 8 lanes: the same integers, no sum can saturate), multiplied by its scale * d_x and fused-multiply-added into
   that position's float lanes, block after block; the offsets (offset * d_x * sum(x_q) per block) go to 8 lanes of
   their own, a unit at a time; both are summed in one fixed tree at the end. So a position's result is the same
   whatever S, the thread count and the SIMD path; gguf_linear's `reference` runs the same arithmetic in plain C (the
   tests compare them bit for bit). */

#include <stdlib.h>

#define QK 32
enum { GGUF_Q4_0 = 2, GGUF_Q4_1 = 3, GGUF_Q5_0 = 6, GGUF_Q5_1 = 7, GGUF_Q8_0 = 8, GGUF_Q4_K = 12, GGUF_Q5_K = 13, GGUF_Q6_K = 14 };
/* float lanes a row's sums are kept in: 16 with AVX-512 VNNI (two blocks an instruction: lanes 0-7 the even block of
   a pair, 8-15 the odd one; a last odd block in lanes 0-7), else 8; the plain C path keeps the same lanes */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_LANES 16
#else
#define GGUF_LANES 8
#endif

static inline float half_to_float(unsigned short h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    unsigned int sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, bits;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 exactly */
        float f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

static inline float f16_at(const unsigned char *p) {
    unsigned short h;
    memcpy(&h, p, 2);
    return half_to_float(h);
}

static inline int k_quant(int type) { return type >= GGUF_Q4_K; }

/* bytes of one block (32 weights) or super-block (256, the K-quants); 0 for a type not taken */
static long block_bytes(int type) {
    switch (type) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    }
    return 0;
}

static inline int unsigned_weights(int type) { /* q in 0..31 with an offset; the others are signed, offset 0 */
    return type == GGUF_Q4_1 || type == GGUF_Q5_1 || type == GGUF_Q4_K || type == GGUF_Q5_K;
}

/* where block b (of 32 weights) of a row starts: its block, or its super-block (b % 8 says which 32 of it) */
static inline const unsigned char *block_at(int type, const unsigned char *row, long b) {
    return k_quant(type) ? row + (b / 8) * block_bytes(type) : row + b * block_bytes(type);
}

/* Q4_K's and Q5_K's eight 6-bit scales and mins, packed in 12 bytes (ggml's get_scale_min_k4, all eight at once) */
static inline __attribute__((always_inline)) void scales_mins_k4(const unsigned char *q, unsigned char sc[8], unsigned char mn[8]) {
    unsigned int u[4];
    memcpy(u, q, 12);
    const unsigned int six = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    u[3] = ((u[2] >> 4) & low4) | (((u[1] >> 6) & top2) << 4);
    unsigned int mins_low = u[1] & six;
    u[1] = (u[2] & low4) | (((u[0] >> 6) & top2) << 4);
    u[2] = mins_low;
    u[0] &= six;
    memcpy(sc, u, 8);
    memcpy(mn, u + 2, 8);
}

/* A unit: blocks u0..u0+n-1 of a row (n <= 8), a K-quant super-block or up to 8 blocks of a 32-weight type, read
   once for all positions: block j's weights 0-15 scale by lh[2j], 16-31 by lh[2j+1] (they differ only in Q6_K), and
   it adds off[j] to every weight (w = scale * q + offset; 0 for the signed types and for blocks past n). */
static inline __attribute__((always_inline)) void unit_scales(int type, const unsigned char *row, long u0, int n, float lh[16], float off[8]) {
    if (k_quant(type)) {
        const unsigned char *u = row + (u0 / 8) * block_bytes(type);
        signed char ints[16];
        float d;
        if (type == GGUF_Q6_K) { /* 16 int8 scales, one per 16 weights */
            memcpy(ints, u + 192, 16);
            d = f16_at(u + 208);
            for (int j = 0; j < 8; j++) off[j] = 0.0f;
        } else {
            unsigned char sc[8], mn[8];
            scales_mins_k4(u + 4, sc, mn);
            d = f16_at(u);
            float dmin = f16_at(u + 2);
            for (int j = 0; j < 8; j++) {
                ints[2 * j] = ints[2 * j + 1] = (signed char)sc[j];
                off[j] = -(dmin * (float)mn[j]);
            }
        }
        for (int i = 0; i < 16; i++) lh[i] = d * (float)ints[i];
    } else {
        long bytes = block_bytes(type);
        for (int j = 0; j < n; j++) {
            const unsigned char *b = row + (u0 + j) * bytes;
            lh[2 * j] = lh[2 * j + 1] = f16_at(b);
            off[j] = unsigned_weights(type) ? f16_at(b + 2) : 0.0f;
        }
        for (int j = n; j < 8; j++) lh[2 * j] = lh[2 * j + 1] = off[j] = 0.0f;
    }
}

/* block b's 32 integer weights, plain C (the reference, and the path without AVX2) */
static inline void decode_scalar(int type, const unsigned char *u, int j, int q[QK]) {
    if (type == GGUF_Q8_0) {
        for (int l = 0; l < QK; l++) q[l] = ((const signed char *)(u + 2))[l];
    } else if (type == GGUF_Q4_K || type == GGUF_Q5_K) {
        const unsigned char *qs = u + (type == GGUF_Q4_K ? 16 : 48) + 32 * (j / 2), *qh = u + 16;
        for (int l = 0; l < QK; l++) {
            q[l] = j % 2 ? qs[l] >> 4 : qs[l] & 0xf;
            if (type == GGUF_Q5_K) q[l] += ((qh[l] >> j) & 1) << 4;
        }
    } else if (type == GGUF_Q6_K) {
        int g = j % 4;
        const unsigned char *ql = u + 64 * (j / 4) + 32 * (g % 2), *qh = u + 128 + 32 * (j / 4);
        for (int l = 0; l < QK; l++) q[l] = ((g >= 2 ? ql[l] >> 4 : ql[l] & 0xf) | (((qh[l] >> 2 * g) & 3) << 4)) - 32;
    } else { /* Q4_0, Q4_1, Q5_0, Q5_1: 16 bytes of nibbles (weight l low, l + 16 high), Q5's fifth bits in 4 bytes */
        int five = type == GGUF_Q5_0 || type == GGUF_Q5_1;
        const unsigned char *qs = u + 2 + 2 * unsigned_weights(type) + 4 * five;
        unsigned int qh = 0;
        if (five) memcpy(&qh, u + 2 + 2 * unsigned_weights(type), 4);
        int shift = type == GGUF_Q4_0 ? 8 : type == GGUF_Q5_0 ? 16 : 0;
        for (int l = 0; l < 16; l++) {
            q[l] = (qs[l] & 0xf) + (int)(((qh >> l) & 1) << 4) - shift;
            q[l + 16] = (qs[l] >> 4) + (int)(((qh >> (l + 16)) & 1) << 4) - shift;
        }
    }
}

/* 8 floats summed in a fixed tree: (l0+l4, l1+l5, l2+l6, l3+l7), then pairs */
static inline __attribute__((always_inline)) float sum8(const float f[8]) {
    float h0 = f[0] + f[4], h1 = f[1] + f[5], h2 = f[2] + f[6], h3 = f[3] + f[7];
    return (h0 + h2) + (h1 + h3);
}

/* the lanes' float sum in a fixed tree: 16 lanes fold to 8 (l + l+8), then sum8 */
static inline __attribute__((always_inline)) float sum_lanes(const float a[GGUF_LANES]) {
    float f[8];
    for (int l = 0; l < 8; l++) f[l] = GGUF_LANES == 16 ? a[l] + a[l + 8] : a[l];
    return sum8(f);
}

/* x [S, D] -> int8 q [S, D], a scale per block d [S, D/32], and d * sum(q) per block sums [S, nbp] (nbp: D/32
   rounded up to whole units of 8 blocks, the padding left as it is: zero) */
static void quantize_rows(const float *x, long S, long D, signed char *q, float *d, float *sums, long nbp) {
    long nb = D / QK;
    for (long r = 0; r < S * nb; r++) {
        const float *v = x + r * QK;
        signed char *out = q + r * QK;
        float amax = 0.0f;
        int total = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        /* the same numbers as the loops below, a block in two registers (the loops were slow, on one thread while
           the others wait) */
        const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        const __m512 vi = _mm512_set1_ps(inv);
        const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC; /* nearbyintf's ties to even */
        const __m512i qa = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(a, vi), round));
        const __m512i qb = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(b, vi), round));
        _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(qb));
        total = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#elif defined(__AVX2__)
        __m256 f[4], m = _mm256_setzero_ps();
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (int i = 0; i < 4; i++) f[i] = _mm256_loadu_ps(v + 8 * i), m = _mm256_max_ps(m, _mm256_andnot_ps(sign, f[i]));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) amax = lanes[j] > amax ? lanes[j] : amax;
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        __m256i k[4], t = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            k[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(f[i], _mm256_set1_ps(inv)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            t = _mm256_add_epi32(t, k[i]);
        }
        const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(k[0], k[1]), _mm256_packs_epi32(k[2], k[3]));
        _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        int parts[8];
        _mm256_storeu_si256((__m256i *)parts, t);
        for (int j = 0; j < 8; j++) total += parts[j];
#else
        for (int j = 0; j < QK; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float scale = amax / 127.0f, inv = scale > 0.0f ? 1.0f / scale : 0.0f;
        for (int j = 0; j < QK; j++) {
            int k = (int)nearbyintf(v[j] * inv);
            out[j] = (signed char)k;
            total += k;
        }
#endif
        d[r] = scale;
        sums[r / nb * nbp + r % nb] = scale * (float)total;
    }
}

#if defined(__AVX2__)
/* lane l: the sum of products 4l..4l+3 of unsigned bytes u and signed bytes s */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

#ifndef PREFETCH
#define PREFETCH 4096
#endif
static inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)); }

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones */
static inline __m256i nibbles16(const unsigned char *qs) {
    __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0f)), high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0f));
    return _mm256_set_m128i(high, low);
}

/* 32 bits -> 32 bytes, 0x10 where the bit is set (ggml's bytes_from_bits_32) */
static inline __m256i fifth_bits(const unsigned char *p) {
    unsigned int bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000);
    __m256i bytes = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread), _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_and_si256(_mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}

/* bits `shift`.. of each byte, masked */
static inline __m256i byte_bits(__m256i v, int shift, int mask) {
    return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(shift)), _mm256_set1_epi8((char)mask));
}

/* block b's 32 weights as bytes (decode_scalar's integers) */
static inline __m256i decode_simd(int type, const unsigned char *u, int j) {
    switch (type) {
    case GGUF_Q4_0: return _mm256_sub_epi8(nibbles16(u + 2), _mm256_set1_epi8(8));
    case GGUF_Q4_1: return nibbles16(u + 4);
    case GGUF_Q5_0: return _mm256_sub_epi8(_mm256_or_si256(nibbles16(u + 6), fifth_bits(u + 2)), _mm256_set1_epi8(16));
    case GGUF_Q5_1: return _mm256_or_si256(nibbles16(u + 8), fifth_bits(u + 4));
    case GGUF_Q8_0: return _mm256_loadu_si256((const __m256i *)(u + 2));
    case GGUF_Q4_K: {
        __m256i qs = _mm256_loadu_si256((const __m256i *)(u + 16 + 32 * (j / 2)));
        return j % 2 ? high_nibbles(qs) : low_nibbles(qs);
    }
    case GGUF_Q5_K: {
        __m256i qs = _mm256_loadu_si256((const __m256i *)(u + 48 + 32 * (j / 2)));
        __m256i high = _mm256_slli_epi16(byte_bits(_mm256_loadu_si256((const __m256i *)(u + 16)), j, 1), 4);
        return _mm256_or_si256(j % 2 ? high_nibbles(qs) : low_nibbles(qs), high);
    }
    default: { /* Q6_K */
        int g = j % 4;
        __m256i ql = _mm256_loadu_si256((const __m256i *)(u + 64 * (j / 4) + 32 * (g % 2)));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(u + 128 + 32 * (j / 4)));
        __m256i q = _mm256_or_si256(g >= 2 ? high_nibbles(ql) : low_nibbles(ql), _mm256_slli_epi16(byte_bits(qh, 2 * g, 3), 4));
        return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
    }
}

/* unit_scales in registers, the same values: lh[0..7] in *lo, lh[8..15] in *hi, the offsets in *off (the K-quants'
   scales widened and multiplied eight at a time; the 32-weight types' read block by block) */
static inline __attribute__((always_inline)) void unit_scales_simd(int type, const unsigned char *row, long u0, int n,
                                                                   __m256 *lo, __m256 *hi, __m256 *off) {
    if (type == GGUF_Q6_K) {
        const unsigned char *u = row + (u0 / 8) * block_bytes(type);
        __m128i sc = _mm_loadu_si128((const __m128i *)(u + 192));
        __m256 d = _mm256_set1_ps(f16_at(u + 208));
        *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
        *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
        *off = _mm256_setzero_ps();
    } else if (k_quant(type)) { /* Q4_K, Q5_K */
        const unsigned char *u = row + (u0 / 8) * block_bytes(type);
        unsigned char sc[8], mn[8];
        scales_mins_k4(u + 4, sc, mn);
        __m128i twice = _mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)sc), _mm_loadl_epi64((const __m128i *)sc)); /* s0 s0 s1 s1 .. */
        __m256 d = _mm256_set1_ps(f16_at(u)), dmin = _mm256_set1_ps(f16_at(u + 2));
        *lo = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(twice)));
        *hi = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(twice, 8))));
        __m256 mins = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn))));
        *off = _mm256_xor_ps(mins, _mm256_set1_ps(-0.0f)); /* -(dmin * m), as unit_scales */
    } else { /* eight blocks' float16 scales (and offsets) gathered, widened at once; none past n */
        long bytes = block_bytes(type);
        const unsigned char *b = row + u0 * bytes;
        __m128i d16 = _mm_setzero_si128(), m16 = _mm_setzero_si128();
        unsigned short h;
#define GATHER(j) if (j < n) { memcpy(&h, b + j * bytes, 2); d16 = _mm_insert_epi16(d16, h, j); \
                               if (unsigned_weights(type)) { memcpy(&h, b + j * bytes + 2, 2); m16 = _mm_insert_epi16(m16, h, j); } }
        GATHER(0) GATHER(1) GATHER(2) GATHER(3) GATHER(4) GATHER(5) GATHER(6) GATHER(7)
#undef GATHER
        __m256 d = _mm256_cvtph_ps(d16);
        *lo = _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
        *hi = _mm256_permutevar8x32_ps(d, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
        *off = _mm256_cvtph_ps(m16);
    }
}

/* sum8's tree in registers: (l0+l4, l1+l5, l2+l6, l3+l7), then (h0+h2) + (h1+h3) */
static inline float sum8_simd(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 pairs = _mm_add_ps(h, _mm_movehl_ps(h, h)); /* h0+h2, h1+h3 */
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

/* block j of a unit: its 8 lanes' weight scales (lanes 0-3 cover weights 0-15, lanes 4-7 weights 16-31) */
static inline __m256 lane_scales(__m256 lo, __m256 hi, int j) {
    __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1), _mm256_set1_epi32(2 * (j % 4)));
    return _mm256_permutevar8x32_ps(j < 4 ? lo : hi, at);
}

/* A unit's start, in both SIMD paths: its weights prefetched ahead, its scales (lo, hi: unit_scales_simd), and its
   offsets times each position's block sums added to that position's offset lanes */
static inline __attribute__((always_inline)) void begin_unit(int type, const unsigned char *row, long u0, int units,
                                                             const float *x_sums, long nbp, const long S, __m256 *offset,
                                                             __m256 *lo, __m256 *hi) {
    const char *ahead = (const char *)block_at(type, row, u0) + PREFETCH;
    _mm_prefetch(ahead, _MM_HINT_T0), _mm_prefetch(ahead + 64, _MM_HINT_T0), _mm_prefetch(ahead + 128, _MM_HINT_T0);
    __m256 off;
    unit_scales_simd(type, row, u0, units, lo, hi, &off);
    if (unsigned_weights(type))
        for (long s = 0; s < S; s++) offset[s] = _mm256_fmadd_ps(off, _mm256_loadu_ps(x_sums + s * nbp + u0), offset[s]);
}

/* rows n0..n1-1 of y for S positions, S a constant where it is inlined (gguf_rows' switch): each weight block is
   decoded once into a register and multiplied into the S positions' accumulators, which stay in registers */
static inline __attribute__((always_inline)) void gguf_rows_simd(const float *x_d, const float *x_sums,
                                                                 const signed char *xq, const unsigned char *w, int type,
                                                                 float *y, long ldy, const long S, long D, long n0, long n1) {
    long nb = D / QK, nbp = (nb + 7) / 8 * 8, row_bytes = D / (k_quant(type) ? 256 : QK) * block_bytes(type);
    int offsets = unsigned_weights(type);
    for (long n = n0; n < n1; n++) {
        const unsigned char *row = w + n * row_bytes;
        __m256 acc[16], offset[16]; /* [S] used: a constant size keeps them in registers, a variable one on the stack */
        for (long s = 0; s < S; s++) acc[s] = _mm256_setzero_ps(), offset[s] = _mm256_setzero_ps();
        for (long u0 = 0; u0 < nb; u0 += 8) {
            int units = nb - u0 < 8 ? (int)(nb - u0) : 8;
            __m256 lo, hi;
            begin_unit(type, row, u0, units, x_sums, nbp, S, offset, &lo, &hi);
            for (int j = 0; j < units; j++) {
                long b = u0 + j;
                __m256i wq = decode_simd(type, block_at(type, row, b), j);
                __m256i abs_w = offsets ? wq : _mm256_sign_epi8(wq, wq); /* |w|, and x takes w's sign below */
                __m256 ws = lane_scales(lo, hi, j);
                for (long s = 0; s < S; s++) {
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (s * nb + b) * QK));
                    __m256i lanes = dot_u8s8(abs_w, offsets ? xv : _mm256_sign_epi8(xv, wq));
                    acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(ws, _mm256_set1_ps(x_d[s * nb + b])), acc[s]);
                }
            }
        }
        for (long s = 0; s < S; s++) y[s * ldy + n] = sum8_simd(acc[s]) + sum8_simd(offset[s]);
    }
}
#endif

#if GGUF_LANES == 16
/* blocks b, b+1 of a row (b even; j = b % 8): Q4_K's pair shares one 32-byte load (low nibbles, then high) */
static inline __m512i decode_pair(int type, const unsigned char *row, long b, int j) {
    if (type == GGUF_Q4_K) {
        __m256i qs = _mm256_loadu_si256((const __m256i *)(row + (b / 8) * 144 + 16 + 16 * j));
        return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(qs), _mm256_srli_epi16(qs, 4), 1), _mm512_set1_epi8(0x0f));
    }
    return _mm512_inserti64x4(_mm512_castsi256_si512(decode_simd(type, block_at(type, row, b), j)),
                              decode_simd(type, block_at(type, row, b + 1), j + 1), 1);
}

/* Two blocks an instruction. Unsigned weights: dpbusd(w, x). Signed ones (AVX-512 has no byte sign instruction):
   dpbusd(x + 128, w) - 128 * sum(w), the same integers. x_dexp holds each block's scale 8 times, so a pair's 16 lane
   scales are one load. */
static inline __attribute__((always_inline)) void gguf_rows_simd512(const float *x_dexp, const float *x_sums,
                                                                    const signed char *xq, const unsigned char *xu,
                                                                    const unsigned char *w, int type, float *y,
                                                                    long ldy, const long S, long D, long n0, long n1) {
    long nb = D / QK, nbp = (nb + 7) / 8 * 8, row_bytes = D / (k_quant(type) ? 256 : QK) * block_bytes(type);
    int offsets = unsigned_weights(type);
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0); /* lh[2j..2j+3], 4 lanes each */
    for (long n = n0; n < n1; n++) {
        const unsigned char *row = w + n * row_bytes;
        __m512 acc[16];
        __m256 offset[16];
        for (long s = 0; s < S; s++) acc[s] = _mm512_setzero_ps(), offset[s] = _mm256_setzero_ps();
        for (long u0 = 0; u0 < nb; u0 += 8) {
            int units = nb - u0 < 8 ? (int)(nb - u0) : 8;
            __m256 lo, hi;
            begin_unit(type, row, u0, units, x_sums, nbp, S, offset, &lo, &hi);
            __m512 scales = _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
            for (int j = 0; j + 1 < units; j += 2) { /* a pair: blocks j, j+1 */
                long b = u0 + j;
                __m512i wq = decode_pair(type, row, b, j);
                __m512 ws = _mm512_permutexvar_ps(_mm512_add_epi32(spread, _mm512_set1_epi32(2 * j)), scales);
                __m512i correction = offsets ? _mm512_setzero_si512() : _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wq);
                for (long s = 0; s < S; s++) {
                    long at = s * nb + b;
                    __m512i lanes = offsets
                        ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, _mm512_loadu_si512(xq + at * QK))
                        : _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_loadu_si512(xu + at * QK), wq), correction);
                    acc[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes), _mm512_mul_ps(ws, _mm512_loadu_ps(x_dexp + at * 8)), acc[s]);
                }
            }
            if (units % 2) { /* a last odd block (32-weight types only): lanes 0-7 */
                int j = units - 1;
                long b = u0 + j;
                __m256i wq = decode_simd(type, block_at(type, row, b), j), abs_w = offsets ? wq : _mm256_sign_epi8(wq, wq);
                __m256 ws = lane_scales(lo, hi, j);
                for (long s = 0; s < S; s++) {
                    long at = s * nb + b;
                    __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + at * QK));
                    __m256i lanes = dot_u8s8(abs_w, offsets ? xv : _mm256_sign_epi8(xv, wq));
                    __m512 scale = _mm512_castps256_ps512(_mm256_mul_ps(ws, _mm256_set1_ps(x_dexp[at * 8])));
                    acc[s] = _mm512_mask3_fmadd_ps(_mm512_cvtepi32_ps(_mm512_castsi256_si512(lanes)), scale, acc[s], 0x00ff);
                }
            }
        }
        for (long s = 0; s < S; s++) {
            __m256 folded = _mm256_add_ps(_mm512_castps512_ps256(acc[s]), _mm512_extractf32x8_ps(acc[s], 1)); /* l + l+8 */
            y[s * ldy + n] = sum8_simd(folded) + sum8_simd(offset[s]);
        }
    }
}
#endif

/* The same arithmetic in plain C, position by position, in the same lanes (the tests' reference; the path
   without AVX2) */
static void gguf_rows_plain(const float *x_d, const float *x_sums, const signed char *xq, const unsigned char *w,
                            int type, float *y, long ldy, long S, long D, long n0, long n1) {
    long nb = D / QK, nbp = (nb + 7) / 8 * 8, row_bytes = D / (k_quant(type) ? 256 : QK) * block_bytes(type);
    for (long n = n0; n < n1; n++) {
        const unsigned char *row = w + n * row_bytes;
        for (long s = 0; s < S; s++) {
            const signed char *xs = xq + s * nb * QK;
            float acc[GGUF_LANES] = {0}, offset[8] = {0};
            for (long b = 0; b < nb; b++) {
                int q[QK], j = (int)(b % 8);
                float lh[16], off[8];
                unit_scales(type, row, b - j, nb - (b - j) < 8 ? (int)(nb - (b - j)) : 8, lh, off);
                decode_scalar(type, block_at(type, row, b), j, q);
                int base = GGUF_LANES == 16 && !(nb % 2 && b == nb - 1) ? (int)(b % 2) * 8 : 0;
                for (int l = 0; l < 8; l++) {
                    int lane = 0;
                    for (int k = 4 * l; k < 4 * l + 4; k++) lane += q[k] * (int)xs[b * QK + k];
                    acc[base + l] = fmaf((float)lane, lh[2 * j + l / 4] * x_d[s * nb + b], acc[base + l]);
                }
                if (unsigned_weights(type) && (j == 7 || b == nb - 1)) /* a unit's offsets, eight lanes as the SIMD paths */
                    for (int l = 0; l < 8; l++) offset[l] = fmaf(off[l], x_sums[s * nbp + b - j + l], offset[l]);
            }
            y[s * ldy + n] = sum_lanes(acc) + sum8(offset);
        }
    }
}

static void gguf_rows(const float *x_d, const float *x_dexp, const float *x_sums, const signed char *xq,
                      const unsigned char *xu, const unsigned char *w, int type, float *y, long ldy, long S, long D,
                      long n0, long n1, int reference) {
    long nb = D / QK, nbp = (nb + 7) / 8 * 8;
    /* positions a weight block is decoded for at once: as many accumulators as the registers hold (more spill, and a
       spill costs more than decoding the block again), in chunks of even size; a position's arithmetic is the same in
       any chunk */
#if GGUF_LANES == 16
    const long chunk = S <= 10 ? S : (S + 1) / 2;
#else
    const long chunk = S <= 4 ? S : (S + (S + 3) / 4 - 1) / ((S + 3) / 4);
#endif
    (void)chunk, (void)nbp;
#if GGUF_LANES == 16
    if (!reference) {
        for (long s0 = 0; s0 < S; s0 += chunk) {
#define GCASE(k) case k: gguf_rows_simd512(x_dexp + s0 * nb * 8, x_sums + s0 * nbp, xq + s0 * D, xu + s0 * D, w, type, \
                                           y + s0 * ldy, ldy, k, D, n0, n1); break;
            switch (S - s0 < chunk ? S - s0 : chunk) {
                GCASE(1) GCASE(2) GCASE(3) GCASE(4) GCASE(5) GCASE(6) GCASE(7) GCASE(8) GCASE(9) GCASE(10)
            }
#undef GCASE
        }
        return;
    }
#elif defined(__AVX2__)
    if (!reference) {
        for (long s0 = 0; s0 < S; s0 += chunk) {
#define GCASE(k) case k: gguf_rows_simd(x_d + s0 * nb, x_sums + s0 * nbp, xq + s0 * D, w, type, y + s0 * ldy, ldy, k, D, n0, n1); break;
            switch (S - s0 < chunk ? S - s0 : chunk) {
                GCASE(1) GCASE(2) GCASE(3) GCASE(4)
            }
#undef GCASE
        }
        return;
    }
#endif
    gguf_rows_plain(x_d, x_sums, xq, w, type, y, ldy, S, D, n0, n1);
}

/* ------------------------------------------------------------------------------------------------------------
   Rows interleaved at load time (gguf_pack, then gguf_parts_into with type PACKED + the ggml type). Why: in the
   file's layout a row's blocks lie together, so every block's few integer products must be converted and scaled in
   float for every position (~2 vector operations a position per 32 weights: the verify cost). Interleaved, one
   dpbusd multiplies 16 rows by 4 weights each against 4 of x's bytes broadcast; a unit's (32 weights deep, 16 for
   Q6_K) integer sums stay integers, and a position pays 3-4 float operations per 16 rows x 32 weights.
   A group of 16 rows, unit by unit: the weights as unsigned integers r (the file's q plus the type's offset: Q4_0 8,
   Q5_0 16, Q6_K 32, Q8_0 128), operand o (4 deep) as 64 bytes, byte 4 * row + i = r[row][4o + i] for Q8_0; every
   other type keeps r's low 4 bits, operand o in the low nibbles and o + ops / 2 in the high ones of 64 bytes, and
   the 5- and 6-bit types the rest of r in a plane of 64 bytes after them (byte 4 * row + i: operand o's 1 or 2 top
   bits at bit 1 * o or 2 * o), so a unit holds the file's bits, no more; then the unit's scales, as compact as
   the file's and exactly its values: the 32-weight types' float16 scale (and offset) for each row; the K-quants'
   integer sub-block scale (and min) for each row, with each row's float16 d (and dmin) once per super-block, ahead
   of its units; scale = d * sc and offset = -(dmin * m) are products exact in float32. w = scale * r + offset (Q4_1,
   Q5_1, Q4_K, Q5_K), or w = scale * (r - k) for the integer offset k. A row's result, position by position:
   acc = fma(float(sum_u), scale * d_x, acc) then acc = fma(offset, d_x * sum(x_q), acc) unit after unit, where sum_u
   is the unit's exact integer sum (minus k * sum(x_q)); the SIMD paths keep 16 (8) rows in the lanes, the plain-C
   reference one row at a time, in the same operations: the same bits whatever S, threads or path. AVX2 without VNNI
   multiplies Q8_0's signed q (|q| times x with q's sign: maddubs would saturate on q + 128): the same integers. */

#define PACKED 100   /* type PACKED + a ggml type: gguf_pack's layout */
#define PACK_ROWS 16
#define PACKED_CHUNK 12 /* positions an AVX-512 pass takes: 2 registers each of 32, the rest for the weights */

static inline int pack_unit(int type) { return type == GGUF_Q6_K ? 16 : 32; } /* weights deep per row scale */
/* every type but Q8_0 keeps its integers' low 4 bits as nibbles (operand o in the low nibbles of 64 bytes, o + ops / 2
   in the high ones) and the 5- and 6-bit types their top bits in a plane after them: the file's bits, no more */
static inline int pack_nibbles(int type) { return type != GGUF_Q8_0; }
static inline int pack_high_bits(int type) {
    return type == GGUF_Q6_K ? 2 : type == GGUF_Q5_0 || type == GGUF_Q5_1 || type == GGUF_Q5_K ? 1 : 0;
}
static inline int pack_int_offset(int type) {
    return type == GGUF_Q4_0 ? 8 : type == GGUF_Q5_0 ? 16 : type == GGUF_Q6_K ? 32 : type == GGUF_Q8_0 ? 128 : 0;
}
static inline int packable(int type) { return block_bytes(type) != 0; }
static inline long unit_weight_bytes(int type) {
    const long weights = (long)pack_unit(type) * PACK_ROWS;
    return pack_nibbles(type) ? weights / 2 + weights * pack_high_bits(type) / 8 : weights;
}
/* a unit's bytes: its weights, then per row a float16 scale (and offset), or the K-quants' sc (and m) bytes */
static inline long unit_bytes(int type) {
    long per_row = k_quant(type) ? (type == GGUF_Q6_K ? 1 : 2) : (pack_int_offset(type) ? 2 : 4);
    return unit_weight_bytes(type) + PACK_ROWS * per_row;
}
/* the K-quants: each row's float16 d (and dmin) once per super-block of 256 / pack_unit units, ahead of them */
static inline long header_bytes(int type) { return k_quant(type) ? PACK_ROWS * 2 * (type == GGUF_Q6_K ? 1 : 2) : 0; }
static inline long units_per_header(int type) { return k_quant(type) ? 256 / pack_unit(type) : 1; }
static inline long header_span(int type) { return header_bytes(type) + units_per_header(type) * unit_bytes(type); }
/* unit u of a group's run (base: the group's first byte) and its super-block's header */
static inline const unsigned char *unit_at(int type, const unsigned char *base, long u) {
    return base + u / units_per_header(type) * header_span(type) + header_bytes(type) + u % units_per_header(type) * unit_bytes(type);
}
static inline const unsigned char *header_at(int type, const unsigned char *base, long u) {
    return base + u / units_per_header(type) * header_span(type);
}
#if defined(__AVX2__)
/* every line of the unit PREFETCH bytes ahead of `unit`, its scales too (the SIMD paths). Always inlined: GCC takes
   a prefetch for an instruction without effects, so a call it leaves out of line is a call to nothing, and it drops
   the call (GCC 12 kept none in the packed paths while this was plain `inline`). */
static inline __attribute__((always_inline)) void prefetch_unit(int type, const unsigned char *unit) {
    for (long o = 0; o < unit_bytes(type); o += 64) _mm_prefetch((const char *)unit + PREFETCH + o, _MM_HINT_T0);
}
#endif

/* bytes gguf_pack writes for N rows of D weights; 0 for a type or shape it does not pack */
long gguf_packed_bytes(int type, long N, long D) {
    if (!packable(type) || D % (k_quant(type) ? 256 : QK) || N < 1) return 0;
    return (N + PACK_ROWS - 1) / PACK_ROWS * (D / pack_unit(type) / units_per_header(type)) * header_span(type);
}

/* w's N rows of blocks -> out (gguf_packed_bytes of them; rows past N in the last group are zeros) */
int gguf_pack(const unsigned char *w, int type, long N, long D, unsigned char *out, int threads) {
    long size = gguf_packed_bytes(type, N, D);
    if (!size) return -1;
    memset(out, 0, size);
    const long nb = D / QK, row_bytes = D / (k_quant(type) ? 256 : QK) * block_bytes(type), U = pack_unit(type);
    const long units = D / U, wb = unit_weight_bytes(type), run = units / units_per_header(type) * header_span(type);
    const int nib = pack_nibbles(type), high = pack_high_bits(type), k = pack_int_offset(type);
    const long groups = (N + PACK_ROWS - 1) / PACK_ROWS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long g = 0; g < groups; g++) {
        const long rows = N - g * PACK_ROWS < PACK_ROWS ? N - g * PACK_ROWS : PACK_ROWS;
        unsigned char *base = out + g * run;
        for (long b = 0; b < nb; b++) {
            const int j = (int)(b % 8);
            unsigned int words[PACK_ROWS][8] = {{0}}; /* row r's 32 integers r as bytes, four to a word */
            for (long r = 0; r < rows; r++) {
                const unsigned char *row = w + (g * PACK_ROWS + r) * row_bytes, *block = block_at(type, row, b);
#if defined(__AVX2__)
                _mm256_storeu_si256((__m256i *)words[r], _mm256_add_epi8(decode_simd(type, block, j), _mm256_set1_epi8((char)k)));
#else
                unsigned char q[QK];
                int ints[QK];
                decode_scalar(type, block, j, ints);
                for (int l = 0; l < QK; l++) q[l] = (unsigned char)(ints[l] + k);
                memcpy(words[r], q, QK);
#endif
                /* the scales, as the file keeps them */
                for (int half = 0; half < 2 && (half == 0 || U == 16); half++) {
                    const long u = (b * QK + 16 * half) / U;
                    unsigned char *tail = (unsigned char *)unit_at(type, base, u) + wb, *head = (unsigned char *)header_at(type, base, u);
                    if (type == GGUF_Q6_K) {
                        tail[r] = block[192 + 2 * j + half];
                        memcpy(head + 2 * r, block + 208, 2);
                    } else if (k_quant(type)) {
                        unsigned char sc[8], mn[8];
                        scales_mins_k4(block + 4, sc, mn);
                        tail[r] = sc[j], tail[PACK_ROWS + r] = mn[j];
                        memcpy(head + 2 * r, block, 2), memcpy(head + 2 * PACK_ROWS + 2 * r, block + 2, 2);
                    } else {
                        memcpy(tail + 2 * r, block, 2);
                        if (!k) memcpy(tail + 2 * PACK_ROWS + 2 * r, block + 2, 2);
                    }
                }
            }
            for (int word = 0; word < 8; word++) { /* weights 4 word .. 4 word + 3: operand o of unit u */
                const long first = b * QK + 4 * word, o = (first % U) / 4, half = U / 8;
                unsigned int *unit = (unsigned int *)unit_at(type, base, first / U);
                if (!nib) {
                    for (long r = 0; r < rows; r++) unit[o * PACK_ROWS + r] = words[r][word];
                    continue;
                }
                /* byte by byte within a word: no bit crosses into the next byte */
                for (long r = 0; r < rows; r++) unit[o % half * PACK_ROWS + r] |= (words[r][word] & 0x0f0f0f0fu) << (4 * (o / half));
                if (high)
                    for (long r = 0; r < rows; r++)
                        unit[half * PACK_ROWS + r] |= (words[r][word] >> 4 & (high == 2 ? 0x03030303u : 0x01010101u)) << (high * o);
            }
        }
    }
    return 0;
}

/* x's integer sums per unit of U: isums [S, D / U] */
static void unit_sums(const signed char *xq, long S, long D, long U, int *isums) {
    for (long a = 0; a < S * D / U; a++) {
        int total = 0;
        for (long i = 0; i < U; i++) total += xq[a * U + i];
        isums[a] = total;
    }
}

/* row r's scale and offset in unit u (tail: the bytes after its weights), as unit_scales computes them */
static inline void packed_scale(int type, const unsigned char *head, const unsigned char *tail, long r, float *scale, float *offset) {
    if (type == GGUF_Q6_K) {
        *scale = f16_at(head + 2 * r) * (float)(signed char)tail[r], *offset = 0.0f;
    } else if (k_quant(type)) {
        *scale = f16_at(head + 2 * r) * (float)tail[r];
        *offset = -(f16_at(head + 2 * PACK_ROWS + 2 * r) * (float)tail[PACK_ROWS + r]);
    } else {
        *scale = f16_at(tail + 2 * r);
        *offset = pack_int_offset(type) ? 0.0f : f16_at(tail + 2 * PACK_ROWS + 2 * r);
    }
}

#if defined(__AVX2__)
/* i + the sums of products 4l..4l+3 of unsigned bytes u and signed bytes s, lane l (no saturation: u <= 63) */
static inline __m256i dot_acc(__m256i i, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(i, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(i, u, s);
#else
    return _mm256_add_epi32(i, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define SIGNED_BYTES 0 /* dpbusd takes Q8_0's q + 128 as it is */
/* products into a unit's 32-bit sums directly (part: a 32-bit sum) */
#define PART_ACC(part, u, s) dot_acc(part, u, s)
#define PART_WIDE(part) (part)
#else
#define SIGNED_BYTES 1
/* Without VNNI a product is maddubs (16-bit pair sums), then madd by ones to 32 bits. The pair sums of up to
   part_terms(type) products are added in 16 bits first (|x| <= 127: they cannot overflow) and widened once: a
   multiply and an add fewer a product, the same integers. */
#define PART_ACC(part, u, s) _mm256_add_epi16(part, _mm256_maddubs_epi16(u, s))
#define PART_WIDE(part) _mm256_madd_epi16(part, _mm256_set1_epi16(1))
#endif

/* how many products PART_ACC may add before PART_WIDE: pair sums are at most 2 * 127 * the largest weight (15 for
   nibbles, 31 for the 5-bit types, 63 for Q6_K), and a 16-bit lane holds 32767 */
static inline int part_terms(int type) { return 8 >> pack_high_bits(type); }

static inline int four_bytes(const signed char *p) {
    int v;
    memcpy(&v, p, 4);
    return v;
}

/* operand o's top bits from a plane (`high` bits an operand, operand o's at bits high * o of each byte), at bits 4.. */
static inline __m256i high_bits256(__m256i plane, int high, int o) {
    const int at = high * o;
    __m256i moved = at < 4 ? _mm256_slli_epi16(plane, 4 - at) : _mm256_srli_epi16(plane, at - 4); /* no kept bit crosses a byte */
    return _mm256_and_si256(moved, _mm256_set1_epi8((char)(high == 2 ? 0x30 : 0x10)));
}

/* rows 8h..8h+7 of group g (those below N) of S positions' sums into y */
static inline void store_half(const __m256 *acc, float *y, long ldy, long S, long N, long g, int h) {
    const long rows = N - g * PACK_ROWS - 8 * h;
    for (long s = 0; s < S; s++) {
        float out[8];
        _mm256_storeu_ps(out, acc[s]);
        for (long r = 0; r < 8 && r < rows; r++) y[s * ldy + g * PACK_ROWS + 8 * h + r] = out[r];
    }
}

/* 8 rows' scales and offsets (rows 8h..8h+7), packed_scale's values */
static inline __attribute__((always_inline)) void packed_scales8(int type, const unsigned char *head, const unsigned char *tail,
                                                                 int h, __m256 *scale, __m256 *offset) {
    if (type == GGUF_Q6_K) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h)));
        *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(tail + 8 * h)))));
        *offset = _mm256_setzero_ps();
    } else if (k_quant(type)) {
        __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 16 * h)));
        __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(head + 2 * PACK_ROWS + 16 * h)));
        *scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tail + 8 * h)))));
        __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(tail + PACK_ROWS + 8 * h))));
        *offset = _mm256_xor_ps(_mm256_mul_ps(dmin, m), _mm256_set1_ps(-0.0f));
    } else {
        *scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 16 * h)));
        *offset = pack_int_offset(type) ? _mm256_setzero_ps() : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(tail + 2 * PACK_ROWS + 16 * h)));
    }
}
#endif

#if GGUF_LANES == 16
static inline __m512i high_bits512(__m512i plane, int high, int o) { /* high_bits256's, 64 bytes */
    const int at = high * o;
    __m512i moved = at < 4 ? _mm512_slli_epi16(plane, 4 - at) : _mm512_srli_epi16(plane, at - 4);
    return _mm512_and_si512(moved, _mm512_set1_epi8((char)(high == 2 ? 0x30 : 0x10)));
}

/* rows g*16..g*16+15 (groups g0..g1-1) for S positions: operands decoded once a unit, each multiplied into every
   position's integer sums */
static inline __attribute__((always_inline)) void packed_rows512(const float *x_d, const float *x_sums, const int *x_isums,
                                                                 const signed char *xq, const unsigned char *p, float *y,
                                                                 long ldy, const long S, long D, long N, long g0, long g1,
                                                                 const int type) {
    const long nb = D / QK, nbp = (nb + 7) / 8 * 8, U = pack_unit(type), units = D / U, wb = unit_weight_bytes(type);
    const long run = units / units_per_header(type) * header_span(type);
    const int nib = pack_nibbles(type), high = pack_high_bits(type), k = pack_int_offset(type), half = U / 8;
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (long g = g0; g < g1; g++) {
        const unsigned char *base = p + g * run;
        __m512 acc[PACKED_CHUNK]; /* [S] used: a constant size keeps them in registers, a variable one on the stack */
        for (long s = 0; s < S; s++) acc[s] = _mm512_setzero_ps();
        for (long u = 0; u < units; u++) {
            const unsigned char *unit = unit_at(type, base, u);
            prefetch_unit(type, unit);
            const long b = u * U / QK;
            __m512i sums[PACKED_CHUNK];
            for (long s = 0; s < S; s++)
                sums[s] = k ? _mm512_set1_epi32(-k * x_isums[s * units + u]) : _mm512_setzero_si512();
            if (nib) { /* operands v and v + half */
                const __m512i plane = high ? _mm512_loadu_si512(unit + 64 * half) : _mm512_setzero_si512();
                for (int v = 0; v < half; v++) {
                    __m512i raw = _mm512_loadu_si512(unit + 64 * v);
                    __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    if (high) {
                        lo = _mm512_or_si512(lo, high_bits512(plane, high, v));
                        hi = _mm512_or_si512(hi, high_bits512(plane, high, v + half));
                    }
                    for (long s = 0; s < S; s++) {
                        const signed char *xs = xq + s * D + u * U;
                        sums[s] = _mm512_dpbusd_epi32(sums[s], lo, _mm512_set1_epi32(four_bytes(xs + 4 * v)));
                        sums[s] = _mm512_dpbusd_epi32(sums[s], hi, _mm512_set1_epi32(four_bytes(xs + 4 * (v + half))));
                    }
                }
            } else {
                for (int o = 0; o < U / 4; o++) {
                    __m512i op = _mm512_loadu_si512(unit + 64 * o);
                    for (long s = 0; s < S; s++)
                        sums[s] = _mm512_dpbusd_epi32(sums[s], op, _mm512_set1_epi32(four_bytes(xq + s * D + u * U + 4 * o)));
                }
            }
            __m256 s_lo, s_hi, o_lo, o_hi;
            packed_scales8(type, header_at(type, base, u), unit + wb, 0, &s_lo, &o_lo);
            packed_scales8(type, header_at(type, base, u), unit + wb, 1, &s_hi, &o_hi);
            __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(s_lo), s_hi, 1);
            __m512 offset = _mm512_insertf32x8(_mm512_castps256_ps512(o_lo), o_hi, 1);
            for (long s = 0; s < S; s++) {
                acc[s] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[s]), _mm512_mul_ps(scale, _mm512_set1_ps(x_d[s * nb + b])), acc[s]);
                if (!k) acc[s] = _mm512_fmadd_ps(offset, _mm512_set1_ps(x_sums[s * nbp + b]), acc[s]);
            }
        }
        long rows = N - g * PACK_ROWS < PACK_ROWS ? N - g * PACK_ROWS : PACK_ROWS;
        for (long s = 0; s < S; s++) _mm512_mask_storeu_ps(y + s * ldy + g * PACK_ROWS, (__mmask16)((1u << rows) - 1), acc[s]);
    }
}
#elif defined(__AVX2__)
/* The same in two halves of 8 rows (bytes 0-31 and 32-63 of each operand), position by position: a unit's operands
   decoded once into registers, then multiplied by each position in turn, whose float sums stay in memory. (The
   AVX-512 path's order, every position's sums in registers, spills on AVX2's 16 registers.) Both halves of a unit
   before the next unit, so the file's lines stream in once, in order (a group's halves one after the other read its
   units twice: 0.85-0.96x the time at 1-9 positions, measured on Zen 3). */
static inline __attribute__((always_inline)) void packed_rows256(const float *x_d, const float *x_sums, const int *x_isums,
                                                                 const signed char *xq, const unsigned char *p, float *y,
                                                                 long ldy, long S, long D, long N, long g0, long g1,
                                                                 const int type) {
    const long nb = D / QK, nbp = (nb + 7) / 8 * 8, U = pack_unit(type), units = D / U, wb = unit_weight_bytes(type);
    const long run = units / units_per_header(type) * header_span(type);
    const int nib = pack_nibbles(type), high = pack_high_bits(type), k = pack_int_offset(type), ops = U / 4, half = ops / 2;
    const int terms = SIGNED_BYTES ? part_terms(type) : ops;
    for (long g = g0; g < g1; g++) {
        const unsigned char *base = p + g * run;
        __m256 accs[2][16]; /* [half][S] */
        for (int h = 0; h < 2; h++)
            for (long s = 0; s < S; s++) accs[h][s] = _mm256_setzero_ps();
        for (long u = 0; u < units; u++) {
            const unsigned char *unit = unit_at(type, base, u);
            prefetch_unit(type, unit);
            for (int h = 0; h < 2; h++) {
                __m256 *acc = accs[h];
                const long b = u * U / QK;
                __m256i w[8]; /* [ops] operands: 8 rows' weights 4o..4o+3 */
                if (nib) {
                    for (int v = 0; v < half; v++) {
                        __m256i raw = _mm256_loadu_si256((const __m256i *)(unit + 64 * v + 32 * h));
                        w[v] = _mm256_and_si256(raw, _mm256_set1_epi8(0x0f));
                        w[v + half] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(0x0f));
                    }
                    if (high) {
                        const __m256i plane = _mm256_loadu_si256((const __m256i *)(unit + 64 * half + 32 * h));
                        for (int o = 0; o < ops; o++) w[o] = _mm256_or_si256(w[o], high_bits256(plane, high, o));
                    }
                } else {
                    for (int o = 0; o < ops; o++) w[o] = _mm256_loadu_si256((const __m256i *)(unit + 64 * o + 32 * h));
                }
                __m256 scale, offset;
                packed_scales8(type, header_at(type, base, u), unit + wb, h, &scale, &offset);
                for (long s = 0; s < S; s++) {
                    const signed char *xs = xq + s * D + u * U;
                    __m256i sum = k ? _mm256_set1_epi32(-k * x_isums[s * units + u]) : _mm256_setzero_si256();
                    for (int o0 = 0; o0 < ops; o0 += terms) {
                        __m256i part = _mm256_setzero_si256();
                        for (int o = o0; o < o0 + terms; o++) part = PART_ACC(part, w[o], _mm256_set1_epi32(four_bytes(xs + 4 * o)));
                        sum = _mm256_add_epi32(sum, PART_WIDE(part));
                    }
                    acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, _mm256_set1_ps(x_d[s * nb + b])), acc[s]);
                    if (!k) acc[s] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x_sums[s * nbp + b]), acc[s]);
                }
            }
        }
        store_half(accs[0], y, ldy, S, N, g, 0);
        store_half(accs[1], y, ldy, S, N, g, 1);
    }
}

#if SIGNED_BYTES
/* Q8_0 without VNNI (its products cannot share 16-bit sums): q = r - 128 times x, by sign and maddubs, position-major
   as the AVX-512 path (S a constant up to 8 where it is inlined: a unit's integer sums and float sums in registers) */
static inline __attribute__((always_inline)) void packed_rows256_q8(const float *x_d, const signed char *xq,
                                                                    const unsigned char *p, float *y, long ldy,
                                                                    const long S, long D, long N, long g0, long g1) {
    const int type = GGUF_Q8_0;
    const long nb = D / QK, units = D / QK, wb = unit_weight_bytes(type), run = units * header_span(type);
    for (long g = g0; g < g1; g++) {
        const unsigned char *base = p + g * run;
        for (int h = 0; h < 2; h++) {
            __m256 acc[8]; /* [S] */
            for (long s = 0; s < S; s++) acc[s] = _mm256_setzero_ps();
            for (long u = 0; u < units; u++) {
                const unsigned char *unit = unit_at(type, base, u);
                if (h == 0) prefetch_unit(type, unit);
                __m256i sums[8];
                for (long s = 0; s < S; s++) sums[s] = _mm256_setzero_si256();
                for (int o = 0; o < QK / 4; o++) {
                    __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(unit + 64 * o + 32 * h)), _mm256_set1_epi8((char)0x80));
                    __m256i size = _mm256_sign_epi8(q, q);
                    for (long s = 0; s < S; s++) {
                        __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(four_bytes(xq + s * D + u * QK + 4 * o)), q);
                        sums[s] = _mm256_add_epi32(sums[s], _mm256_madd_epi16(_mm256_maddubs_epi16(size, xs), _mm256_set1_epi16(1)));
                    }
                }
                __m256 scale, offset;
                packed_scales8(type, header_at(type, base, u), unit + wb, h, &scale, &offset);
                for (long s = 0; s < S; s++)
                    acc[s] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[s]), _mm256_mul_ps(scale, _mm256_set1_ps(x_d[s * nb + u])), acc[s]);
            }
            store_half(acc, y, ldy, S, N, g, h);
        }
    }
}
#endif
#endif

/* the same arithmetic in plain C, a row and a position at a time (the tests' reference; the path without AVX2) */
static void packed_rows_plain(const float *x_d, const float *x_sums, const int *x_isums, const signed char *xq,
                              const unsigned char *p, int type, float *y, long ldy, long S, long D, long N, long g0, long g1) {
    const long nb = D / QK, nbp = (nb + 7) / 8 * 8, U = pack_unit(type), units = D / U, wb = unit_weight_bytes(type);
    const long run = units / units_per_header(type) * header_span(type);
    const int nib = pack_nibbles(type), high = pack_high_bits(type), k = pack_int_offset(type), half = U / 8;
    for (long n = g0 * PACK_ROWS; n < g1 * PACK_ROWS && n < N; n++) {
        const long g = n / PACK_ROWS, r = n % PACK_ROWS;
        const unsigned char *base = p + g * run;
        for (long s = 0; s < S; s++) {
            float acc = 0.0f;
            for (long u = 0; u < units; u++) {
                const unsigned char *unit = unit_at(type, base, u);
                const signed char *xs = xq + s * D + u * U;
                const long b = u * U / QK;
                int sum = -k * x_isums[s * units + u];
                for (long t = 0; t < U; t++) {
                    long o = t / 4, i = t % 4;
                    int raw = nib ? (unit[(o % half) * 64 + 4 * r + i] >> (4 * (o / half))) & 0xf : unit[o * 64 + 4 * r + i];
                    if (high) raw |= (unit[half * 64 + 4 * r + i] >> (high * o) & ((1 << high) - 1)) << 4;
                    sum += raw * xs[t];
                }
                float scale, offset;
                packed_scale(type, header_at(type, base, u), unit + wb, r, &scale, &offset);
                acc = fmaf((float)sum, scale * x_d[s * nb + b], acc);
                if (!k) acc = fmaf(offset, x_sums[s * nbp + b], acc);
            }
            y[s * ldy + n] = acc;
        }
    }
}

#define PACKED_TYPES(TYPE) TYPE(GGUF_Q4_0) TYPE(GGUF_Q4_1) TYPE(GGUF_Q5_0) TYPE(GGUF_Q5_1) TYPE(GGUF_Q8_0) \
                           TYPE(GGUF_Q4_K) TYPE(GGUF_Q5_K) TYPE(GGUF_Q6_K)

/* groups g0..g1-1 of S positions; the AVX-512 path up to PACKED_CHUNK positions at once (a register each for the
   integer and the float sums), in even chunks */
static void packed_rows(const float *x_d, const float *x_sums, const int *x_isums, const signed char *xq,
                        const unsigned char *p, int type, float *y, long ldy, long S, long D, long N, long g0, long g1,
                        int reference) {
#if GGUF_LANES == 16
    if (!reference) {
        const long nb = D / QK, nbp = (nb + 7) / 8 * 8, units = D / pack_unit(type);
        const long chunk = S <= PACKED_CHUNK ? S : (S + 1) / 2;
        for (long s0 = 0; s0 < S; s0 += chunk) {
            const long n = S - s0 < chunk ? S - s0 : chunk;
            const float *d = x_d + s0 * nb, *sums = x_sums + s0 * nbp;
            const int *is = x_isums + s0 * units;
            const signed char *xs = xq + s0 * D;
            float *ys = y + s0 * ldy;
#define ROWS(n, t) case n: packed_rows512(d, sums, is, xs, p, ys, ldy, n, D, N, g0, g1, t); break;
#define TYPE(t) case t: switch (n) { ROWS(1, t) ROWS(2, t) ROWS(3, t) ROWS(4, t) ROWS(5, t) ROWS(6, t) ROWS(7, t) \
                                     ROWS(8, t) ROWS(9, t) ROWS(10, t) ROWS(11, t) default: ROWS(12, t) } break;
            switch (type) { PACKED_TYPES(TYPE) }
#undef TYPE
#undef ROWS
        }
        return;
    }
#elif defined(__AVX2__)
#if SIGNED_BYTES
    if (!reference && type == GGUF_Q8_0) {
        for (long s0 = 0; s0 < S; s0 += 8) { /* chunks of 8: the last the rest */
            const long n = S - s0 < 8 ? S - s0 : 8;
            const float *d = x_d + s0 * (D / QK);
            const signed char *xs = xq + s0 * D;
            float *ys = y + s0 * ldy;
#define ROWS(n) case n: packed_rows256_q8(d, xs, p, ys, ldy, n, D, N, g0, g1); break;
            switch (n) { ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8) }
#undef ROWS
        }
        return;
    }
#endif
    if (!reference) {
#define ROWS(n, t) packed_rows256(x_d, x_sums, x_isums, xq, p, y, ldy, n, D, N, g0, g1, t)
#define TYPE(t) case t: if (S == 1) ROWS(1, t); else if (S == 2) ROWS(2, t); else ROWS(S, t); break; /* (Q8_0: above) */
        switch (type) { PACKED_TYPES(TYPE) }
#undef ROWS
#undef TYPE
        return;
    }
#endif
    packed_rows_plain(x_d, x_sums, x_isums, xq, p, type, y, ldy, S, D, N, g0, g1);
}

static void rounded_free(struct rounded *r) {
    free(r->xq), free(r->xu), free(r->x_d), free(r->x_sums), free(r->x_dexp), free(r->isums32), free(r->isums16);
}

static int rounded_alloc(struct rounded *r, long S, long D) {
    const long nbp = (D / QK + 7) / 8 * 8;
    r->xq = malloc(S * D), r->xu = malloc(S * D);
    r->x_d = malloc(sizeof(float) * S * nbp), r->x_sums = malloc(sizeof(float) * S * nbp);
    r->x_dexp = malloc(sizeof(float) * S * nbp * 8);
    r->isums32 = malloc(sizeof(int) * S * (D / 32 + 1)), r->isums16 = malloc(sizeof(int) * S * (D / 16 + 1));
    if (r->xq && r->xu && r->x_d && r->x_sums && r->x_dexp && r->isums32 && r->isums16) return 0;
    rounded_free(r);
    return -1;
}

/* what of x the parts' types read (bits: 1 interleaved rows of 32-deep units, 2 of 16, 4 the file's layout); 0 for a
   type or shape gguf_parts_into does not take */
static int parts_read(int n, const int *types, const long *rows, long S, long D) {
    if (S < 1 || S > 16 || n < 1 || n > 3) return 0;
    int reads = 0;
    for (int i = 0; i < n; i++) {
        const int packed = types[i] >= PACKED, base = packed ? types[i] - PACKED : types[i];
        if (D % (k_quant(base) ? 256 : QK) || !block_bytes(base) || rows[i] < 1) return 0;
        reads |= !packed ? 4 : pack_unit(base) == 16 ? 2 : 1;
    }
    return reads;
}

/* row s of x rounded for every part that reads it (by the thread that wrote the row) */
static void round_row(const float *x, long s, long D, int reads, struct rounded *r) {
    const long nb = D / QK, nbp = (nb + 7) / 8 * 8; /* blocks a row's sums are kept for: whole units of 8 */
    signed char *xq = r->xq + s * D;
    memset(r->x_sums + s * nbp, 0, sizeof(float) * nbp);
    quantize_rows(x + s * D, 1, D, xq, r->x_d + s * nb, r->x_sums + s * nbp, nbp);
    if (reads & 1) unit_sums(xq, 1, D, 32, r->isums32 + s * (D / 32));
    if (reads & 2) unit_sums(xq, 1, D, 16, r->isums16 + s * (D / 16));
    if (reads & 4) {
        for (long i = 0; i < D; i++) r->xu[s * D + i] = (unsigned char)(xq[i] + 128);
        for (long i = 0; i < nb * 8; i++) r->x_dexp[s * nb * 8 + i] = r->x_d[s * nb + i / 8];
    }
}

/* y[S, N] (+ bias[N]) = x @ w^T on the calling team, x rounded in r (round_row): part p's rows[p] rows of blocks of
   types[p] into the next rows[p] columns of y (rows ldy floats apart); one loop takes 16 rows at a time from any part.
   Guided: a thread takes half of what is left, then less and less, so a thread slowed by the machine (a VM's core)
   is not waited for at the loop's end, while each still streams long runs of rows; a group's sums are the same
   whichever thread computes them. */
static void parts_team(const struct rounded *r, int n, const unsigned char *const *w, const int *types, const long *rows,
                       const float *bias, float *y, long ldy, long S, long D, int reference) {
    long first_task[4] = {0}, column[4] = {0};
    for (int i = 0; i < n; i++) {
        first_task[i + 1] = first_task[i] + (rows[i] + PACK_ROWS - 1) / PACK_ROWS; /* tasks of 16 rows */
        column[i + 1] = column[i] + rows[i];
    }
#pragma omp for schedule(guided)
    for (long t = 0; t < first_task[n]; t++) {
        int i = 0;
        while (t >= first_task[i + 1]) i++;
        const long g = t - first_task[i], n1 = (g + 1) * PACK_ROWS < rows[i] ? (g + 1) * PACK_ROWS : rows[i];
        const int packed = types[i] >= PACKED, base = packed ? types[i] - PACKED : types[i];
        if (packed)
            packed_rows(r->x_d, r->x_sums, pack_unit(base) == 16 ? r->isums16 : r->isums32, r->xq, w[i], base,
                        y + column[i], ldy, S, D, rows[i], g, g + 1, reference);
        else
            gguf_rows(r->x_d, r->x_dexp, r->x_sums, r->xq, r->xu, w[i], base, y + column[i], ldy, S, D, g * PACK_ROWS, n1,
                      reference);
        if (bias)
            for (long s = 0; s < S; s++)
                for (long c = column[i] + g * PACK_ROWS; c < column[i] + n1; c++) y[s * ldy + c] += bias[c];
    }
}

/* y[S, N] = x[S, D] @ w^T for w stacked from n parts (1-3), part p rows[p] rows of GGUF blocks of types[p] (PACKED +
   type: gguf_pack's interleaved rows), its outputs in the next rows[p] columns of y; y's rows ldy floats apart (N for
   a matrix of its own); 1 <= S <= 16, D a multiple of 32 (of 256 for the K-quants). x is rounded to int8 once for all
   parts, and one parallel loop takes 16 rows at a time from any part ([q; k; v] is one call, not three: each call
   costs microseconds a small model's step pays ~200 times). 0, or -1 for a type or shape it does not take. */
int gguf_parts_into(const float *x, int n, const unsigned char *const *w, const int *types, const long *rows, float *y,
                    long ldy, long S, long D, int threads, int reference) {
    const int reads = parts_read(n, types, rows, S, D);
    struct rounded r;
    if (!reads || rounded_alloc(&r, S, D)) return -1;
    for (long s = 0; s < S; s++) round_row(x, s, D, reads, &r);
#pragma omp parallel num_threads(threads) if (threads > 1)
    parts_team(&r, n, w, types, rows, NULL, y, ldy, S, D, reference);
    rounded_free(&r);
    return 0;
}

int gguf_linear(const float *x, const unsigned char *w, int type, float *y, long S, long N, long D, int threads,
                int reference) {
    return gguf_parts_into(x, 1, &w, &type, &N, y, N, S, D, threads, reference);
}

/* ---- Rows of a vocabulary: sampling's passes over one row of logits or probabilities ----
   A round's warping, draw and token inspector took a dozen library passes over the vocabulary's row, each from
   caches the forward had just swept; here each is one call. Probabilities are nonnegative, NaN never enters a top list. */

static inline int any_above(vec v, float t) { /* whether some lane of v is > t */
#if defined(__AVX512F__)
    __m512 m;
    memcpy(&m, &v, sizeof v);
    return _mm512_cmp_ps_mask(m, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX__)
    __m256 m;
    memcpy(&m, &v, sizeof v);
    return _mm256_movemask_ps(_mm256_cmp_ps(m, _mm256_set1_ps(t), _CMP_GT_OQ)) != 0;
#else
    for (int l = 0; l < LANES; l++)
        if (v[l] > t) return 1;
    return 0;
#endif
}

/* x into the sorted top list vals/ids (have < n, or full: x displaces the last), after the values >= x: a later equal
   value never displaces an earlier one, so ties keep the lower id first */
static inline int top_insert(float *vals, long *ids, int have, int n, float x, long id) {
    int j = have < n ? have++ : n - 1;
    for (; j > 0 && vals[j - 1] < x; j--) vals[j] = vals[j - 1], ids[j] = ids[j - 1];
    vals[j] = x, ids[j] = id;
    return have;
}

/* the n largest of x[V] and their ids, largest first, ties to the lower id (torch.topk's order); a vector of LANES
   values is looked at only when one beats the n-th so far. Returns how many it found (n, unless x has NaNs) */
int row_top(const float *x, long V, int n, long *ids, float *vals) {
    int have = 0;
    long i = 0;
    for (; i < V && have < n; i++)
        if (x[i] == x[i]) have = top_insert(vals, ids, have, n, x[i], i);
    for (; i < V && i % LANES; i++)
        if (x[i] > vals[n - 1]) top_insert(vals, ids, have, n, x[i], i);
    for (; i + LANES <= V; i += LANES)
        if (any_above(load(x + i), vals[n - 1]))
            for (long j = i; j < i + LANES; j++)
                if (x[j] > vals[n - 1]) top_insert(vals, ids, have, n, x[j], j);
    for (; i < V; i++)
        if (x[i] > vals[n - 1]) top_insert(vals, ids, have, n, x[i], i);
    return have;
}

/* sum_i e^((x_i - m) / t), each term written to e[i] when e is not NULL (e may be x); e^-inf (a masked logit) is 0 */
double row_exp_sum(const float *x, long V, float m, float t, float *e) {
    const vec zero = {0}, lo = zero - 87.3365447504019f;
    vec acc[4] = {{0}};
    long i = 0;
    for (; i + 4 * LANES <= V; i += 4 * LANES)
        for (int c = 0; c < 4; c++) {
            const vec a = (load(x + i + c * LANES) - m) / t, v = vselect(a < lo, zero, vexp(a));
            if (e) memcpy(e + i + c * LANES, &v, sizeof v);
            acc[c] += v;
        }
    double s = hsum_tree((acc[0] + acc[1]) + (acc[2] + acc[3]));
    for (; i < V; i++) {
        const float a = (x[i] - m) / t, v = a < -87.3365447504019f ? 0.0f : sexp(a);
        if (e) e[i] = v;
        s += v;
    }
    return s;
}

struct scored { float v; long id; };

static int by_value_then_id(const void *a, const void *b) {
    const struct scored *x = a, *y = b;
    if (x->v != y->v) return x->v < y->v ? 1 : -1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* keep the most likely e[i] whose mass before them (sorted by value, ties the lower id first; float64 sums) is below
   top_p * total, and scale those to sum to 1, the rest 0. Only entries above a cut are sorted: when their mass
   reaches top_p * total, every entry at or below the cut has at least that much before it and is dropped; the cut
   falls (1e-2, 1e-4 of the total, then 0) until it does. Returns the number kept, -1 when out of memory. */
static long nucleus_of(float *e, long V, double total, float top_p) {
    struct scored *c = malloc(sizeof *c * V);
    if (!c) return -1;
    const double need = (double)top_p * total, floors[3] = {1e-2 * total, 1e-4 * total, 0.0};
    long n = 0, kept = 0;
    double mass = 0.0; /* of the kept entries */
    for (int f = 0; f < 3; f++) {
        const float cut = (float)floors[f];
        long i = 0;
        n = 0;
        for (; i + LANES <= V; i += LANES)
            if (any_above(load(e + i), cut))
                for (long j = i; j < i + LANES; j++)
                    if (e[j] > cut) c[n].v = e[j], c[n++].id = j;
        for (; i < V; i++)
            if (e[i] > cut) c[n].v = e[i], c[n++].id = i;
        qsort(c, n, sizeof *c, by_value_then_id);
        for (kept = 0, mass = 0.0; kept < n && mass < need; kept++) mass += c[kept].v;
        if (mass >= need || f == 2) break;
    }
    memset(e, 0, sizeof(float) * V);
    for (long j = 0; j < kept; j++) e[c[j].id] = (float)(c[j].v / mass);
    free(c);
    return kept;
}

/* logits x[V] -> probabilities p[V] (p may be x): softmax(x / t) over e^((x_i - max) / t), then for top_p < 1 the
   nucleus (`nucleus_of`). Returns how many are nonzero, -1 for a row without mass or out of memory. */
long row_probs(const float *x, long V, float t, float top_p, float *p) {
    long id;
    float m;
    if (row_top(x, V, 1, &id, &m) < 1) return -1;
    const double total = row_exp_sum(x, V, m, t, p);
    if (!(total > 0.0)) return -1;
    if (top_p < 1.0f) return nucleus_of(p, V, total, top_p);
    const float inv = (float)(1.0 / total);
    long nonzero = 0;
    for (long i = 0; i < V; i++) p[i] *= inv, nonzero += p[i] > 0.0f;
    return nonzero;
}

/* the id a uniform u in [0, 1) draws from p[V] (nonnegative, any total): the first whose cumulative sum (float64, in id
   order) exceeds u * total, kept below total. Zeros add nothing to the sums, so vectors of zeros are skipped: the
   same draws, bit for bit, as summing every entry. -1 for a row without mass. */
long row_draw(const float *p, long V, double u) {
    double total = 0.0;
    long i = 0;
    for (; i + LANES <= V; i += LANES)
        if (any_above(load(p + i), 0.0f))
            for (long j = i; j < i + LANES; j++) total += p[j];
    for (; i < V; i++) total += p[i];
    if (!(total > 0.0)) return -1;
    double x = u * total, cdf = 0.0;
    if (x >= total) x = nextafter(total, 0.0);
    for (i = 0; i + LANES <= V; i += LANES)
        if (any_above(load(p + i), 0.0f))
            for (long j = i; j < i + LANES; j++)
                if (p[j] > 0.0f && (cdf += p[j]) > x) return j;
    for (; i < V; i++)
        if (p[i] > 0.0f && (cdf += p[i]) > x) return i;
    long last = V - 1; /* x < total: unreachable but for rounding; the last entry with mass */
    while (last > 0 && !(p[last] > 0.0f)) last--;
    return last;
}

/* Where part t of P starts when V columns are split as the LM head's parallel loop splits its tasks of 16 rows
   (OpenMP's static schedule: contiguous runs, the first T % P threads one task more): each thread then reads back
   what it wrote, from its own caches. */
static long part_start(long V, int t, int P) {
    const long T = (V + 15) / 16, q = T / P, r = T % P, task = t * q + (t < r ? t : r);
    return task * 16 < V ? task * 16 : V;
}

/* per row r of x [R, V]: its n <= 64 largest values and their ids (largest first, ties to the lower id), and log
   sum_i e^x_i (-inf for a row of -inf), in one pass of the threads over their parts of each row and one over it again
   with the row's maximum (row_exp_sum); the parts' lists merged and their sums added in part order, in float64. Returns
   the fewest values found in a row (n, unless a row has NaNs or fewer than n values), -1 out of memory. */
int rows_summary(const float *x, long R, long V, int n, long *ids, float *vals, double *log_z, int threads) {
    if (n < 1 || n > 64 || R < 1 || threads < 1) return -1;
    const int P = threads > 16 ? 16 : threads;
    long *part_ids = malloc(sizeof(long) * P * R * n);
    float *part_vals = malloc(sizeof(float) * P * R * n);
    int *found = malloc(sizeof(int) * P * R);
    double *sums = malloc(sizeof(double) * P * R);
    int fewest = -1, team = 1;
    if (!part_ids || !part_vals || !found || !sums) goto done;
#pragma omp parallel num_threads(P)
    {
        const int t = omp_get_thread_num(), parts = omp_get_num_threads();
        const long a = part_start(V, t, parts), b = part_start(V, t + 1, parts);
        for (long r = 0; r < R; r++) {
            long *pi = part_ids + (t * R + r) * n;
            found[t * R + r] = b > a ? row_top(x + r * V + a, b - a, n, pi, part_vals + (t * R + r) * n) : 0;
            for (int j = 0; j < found[t * R + r]; j++) pi[j] += a;
        }
#pragma omp barrier
        for (long r = 0; r < R; r++) {
            float m = -INFINITY;
            for (int u = 0; u < parts; u++)
                if (found[u * R + r] && part_vals[(u * R + r) * n] > m) m = part_vals[(u * R + r) * n];
            sums[t * R + r] = b > a && m > -INFINITY ? row_exp_sum(x + r * V + a, b - a, m, 1.0f, NULL) : 0.0;
        }
#pragma omp single
        team = parts; /* (it may be below P) */
    }
    {
        const int parts = team;
        fewest = n;
        for (long r = 0; r < R; r++) {
            int have = 0;
            float *v = vals + r * n;
            long *id = ids + r * n;
            for (int u = 0; u < parts; u++) /* parts in id order: an equal value from a later part stays behind */
                for (int j = 0; j < found[u * R + r]; j++) {
                    const float y = part_vals[(u * R + r) * n + j];
                    if (have < n || y > v[n - 1]) have = top_insert(v, id, have, n, y, part_ids[(u * R + r) * n + j]);
                }
            double s = 0.0;
            for (int u = 0; u < parts; u++) s += sums[u * R + r];
            log_z[r] = have && s > 0.0 ? (double)v[0] + log(s) : -INFINITY;
            if (have < fewest) fewest = have;
        }
    }
done:
    free(part_ids), free(part_vals), free(found), free(sums);
    return fewest;
}
