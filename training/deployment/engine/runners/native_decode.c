/* One decode step of the lean forward (Llama / Qwen2 / Qwen3) on CPU in fp32 or bf16, in a single call.

   Compiled on first use by native.py (gcc -O3 -march=native -fopenmp) and called through ctypes;
   native.py states the contract and holds the weights. Everything here is plain C on GCC vector
   extensions (16 floats), so it builds wherever gcc does; on AVX-512 a vector is one register.

   Per layer:  h = rmsnorm(x)  ->  qkv = h W_qkv^T (+b)  ->  per-head q/k norm (Qwen3), RoPE
               ->  k, v written at the row's KV slot  ->  attention  ->  x += o W_o^T (+b)
               ->  h = rmsnorm(x)  ->  a = silu(g) * u, [g u] = h W_gu^T (+b)  ->  x += a W_down^T (+b)
   then logits = rmsnorm(x) W_head^T.

   Matmuls: weights packed in panels of NB output columns, [N/NB][K][NB] (pack_weight), so a panel
   is one contiguous run that a thread streams once per step; while it works on one panel it asks
   for the next one (a software prefetch into L2), which is what keeps cold weights flowing: a
   decode step reads every weight once, from memory, not from cache.

   KV cache: a pool of blocks of block_size positions (kv_cache.py); a row's position p is in block
   table[p / block_size] of its block table, at offset p % block_size, and inside a block the keys of one
   kv head are one contiguous run. The step gets each row's table; keys are read in runs that never cross
   a block boundary, the next run prefetched while the current one is attended.

   Attention: one task per (segment, kv head). A segment is a set of rows that share the blocks (or hold
   bitwise copies) of one prefix at positions [0, P) (a GRPO group: its prefix is read once for all its
   rows' queries) or a single row (P = 0). Online softmax (running max and sum) over chunks of keys:
   first the shared prefix for every query of the segment, then each row's own keys [P, len).
   A few queries take a chunk of 16 keys as one vector of scores each (attend_keys_v); 8 to 32
   queries over a prefix go across the lanes instead (attend_keys_wide); a head_dim that is not a
   multiple of 16 takes the scalar loops (attend_keys_scalar).

   bf16 (built with -DNATIVE_BF16, a library of its own): the matmul weights, the embedding and the K/V pool are
   bf16 (half the bytes to stream); everything else is fp32: the residual stream, every accumulation, the norms
   (their weights given as fp32 copies), RoPE, softmax, SiLU and the logits. The matmul weights are widened to
   fp32 as they are streamed (a 16-bit shift) and multiply fp32 activations: the kernel for every CPU. With
   -DNATIVE_BF16_AMX (native.py's default) on a CPU with AMX (__AMX_BF16__) the matmuls run on AMX tiles instead
   (blocks of 32 rows x 32 columns, 32 k per tdpbf16ps); with -DNATIVE_BF16_DOT on a CPU with AVX-512 BF16 on
   vdpbf16ps (two products per lane per instruction). Both take the activations rounded to bf16 and the weights
   packed in pairs along K. Measured on a Sapphire Rapids VM (engine README, "The native step in bf16"): AMX
   3-10x the widening kernel at 32-64 rows, vdpbf16ps half of it, so vdpbf16ps is never the default. K and V
   are widened as they are read, and rounded to bf16 (to nearest even) as they are written.

   Also here: the plain-row sampler (sample_plain) and the prefill's elementwise passes (rope_store,
   rmsnorm_rows, silu_mul); the prefill's matmuls and attention stay torch's. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));

/* wt: a matmul weight (and embedding) element; kv_t: a K/V pool element. */
#ifdef NATIVE_BF16
typedef uint16_t wt;
typedef uint16_t kv_t;
#if defined(NATIVE_BF16_AMX) && defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__)
#define BF16_AMX 1 /* the matmuls on AMX tiles where Linux grants them, else on vdpbf16ps */
#define BF16_DOT 1
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(NATIVE_BF16_DOT) && defined(__AVX512BF16__)
#define BF16_DOT 1 /* the matmuls on vdpbf16ps */
#endif
#ifdef BF16_DOT
#include <immintrin.h>
#endif
#else
typedef float wt;
typedef float kv_t;
#endif

/* bf16 <-> fp32: a bf16 is the top half of an fp32; rounding to nearest even, NaN kept NaN. */
static inline float bf16_widen(uint16_t h) {
    union { uint32_t u; float f; } v = {(uint32_t)h << 16};
    return v.f;
}

static inline uint16_t bf16_round(float f) {
    union { float f; uint32_t u; } v = {f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* 16 K/V values from p as fp32; one value; n values rounded into the pool (fp32: a plain load / copy). */
#ifdef NATIVE_BF16
static inline v16 kv_load16(const kv_t *p) { return (v16)(__builtin_convertvector(*(const vh16 *)p, vu16) << 16); }
static inline float kv_get(const kv_t *p, int j) { return bf16_widen(p[j]); }
static inline void kv_store(kv_t *dst, const float *src, int n) {
#pragma omp simd
    for (int j = 0; j < n; j++) dst[j] = bf16_round(src[j]);
}
static inline void widen_row(float *dst, const wt *src, int n) {
#pragma omp simd
    for (int j = 0; j < n; j++) dst[j] = bf16_widen(src[j]);
}
#else
static inline v16 kv_load16(const kv_t *p) { return *(const v16 *)p; }
static inline float kv_get(const kv_t *p, int j) { return p[j]; }
static inline void kv_store(kv_t *dst, const float *src, int n) { memcpy(dst, src, sizeof(float) * n); }
static inline void widen_row(float *dst, const wt *src, int n) { memcpy(dst, src, sizeof(float) * n); }
#endif

/* Built with -DNATIVE_PROFILE (native.py's profile build, benchmarks/profile_decode.py --kernel native):
   decode_step adds the wall time of each phase to native_phase_seconds (native.PHASES names them). */
#ifdef NATIVE_PROFILE
double native_phase_seconds[6];
#define PHASE_START double phase_t0 = omp_get_wtime();
#define PHASE(i)                                    \
    {                                               \
        double phase_now = omp_get_wtime();         \
        native_phase_seconds[i] += phase_now - phase_t0; \
        phase_t0 = phase_now;                       \
    }
#else
#define PHASE_START
#define PHASE(i)
#endif

#define NB 32          /* output columns per weight panel (two vectors) */
#define MR_MAX 12      /* rows of a matmul block: 2 * MR_MAX accumulators stay in registers */
#define KEY_BLOCK 32   /* keys per online-softmax block (scalar path; the vector path takes 16) */

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, inter, vocab, block_size, num_blocks;
    float eps;
    const float *const *in_norm, *const *post_norm;                      /* [layers] -> [hidden] */
    const wt *const *qkv_w, *const *o_w, *const *gate_up_w, *const *down_w;  /* packed (pack_weight) */
    const float *const *qkv_b, *const *o_b, *const *gate_up_b, *const *down_b;  /* padded to panels, or NULL */
    const float *const *q_norm, *const *k_norm;                          /* [head_dim] (Qwen3), or NULL */
    kv_t *k_cache, *v_cache;        /* the block pool: [layers][num_blocks + 1][kv_heads][block_size][head_dim] */
    const wt *embed;                /* [vocab][hidden], plain */
    const float *final_norm;        /* [hidden] */
    const wt *lm_head;              /* packed */
    const float *cos, *sin_signed;  /* [max_model_len][head_dim]: x*cos + roll(x, d/2)*sin_signed is RoPE */
} Model;

/* ------------------------------------------------------------------ helpers */

static inline int panels_of(int n) { return (n + NB - 1) / NB; }

/* e^x for x <= 88 (Cephes' single-precision polynomial, ~1 ulp), 0 below -87 (where fp32 leaves its
   normal range); written to vectorise in simd loops. */
static inline float exp_f32(float x) {
    if (x < -87.0f) return 0.0f;
    x = x > 88.0f ? 88.0f : x;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float z = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    union { int32_t i; float f; } s;
    s.i = ((int32_t)n + 127) << 23;
    return p * s.f;
}

typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

static inline v16 v16_splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 v16_select(vi16 mask, v16 a, v16 b) { return (v16)((mask & (vi16)a) | (~mask & (vi16)b)); }

/* exp_f32 on 16 lanes */
static inline v16 v16_exp(v16 x) {
    const v16 lo = v16_splat(-87.0f), hi = v16_splat(88.0f), magic = v16_splat(12582912.0f); /* 1.5 * 2^23 */
    const vi16 under = x < lo;
    x = v16_select(under, lo, x);
    x = v16_select(x > hi, hi, x);
    v16 n = (x * 1.44269504088896341f + magic) - magic; /* round to nearest */
    v16 r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    v16 z = r * r;
    v16 p = v16_splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * z + r + 1.0f;
    vi16 e = (__builtin_convertvector(n, vi16) + 127) << 23;
    return v16_select(under, (v16){0}, p * (v16)e);
}

static inline v16 v16_max(v16 a, v16 b) { return v16_select(a > b, a, b); }

/* the largest lane / the sum of the lanes (a shuffle tree: every lane ends up holding the result) */
static inline float v16_max_lane(v16 x) {
    x = v16_max(x, __builtin_shuffle(x, (vi16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
    x = v16_max(x, __builtin_shuffle(x, (vi16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
    x = v16_max(x, __builtin_shuffle(x, (vi16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
    x = v16_max(x, __builtin_shuffle(x, (vi16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
    return x[0];
}

static inline float v16_sum_lanes(v16 x) {
    x += __builtin_shuffle(x, (vi16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    x += __builtin_shuffle(x, (vi16){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    x += __builtin_shuffle(x, (vi16){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
    x += __builtin_shuffle(x, (vi16){1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
    return x[0];
}

/* out[t] = sum of the lanes of p[t], for 16 vectors (a butterfly of 30 two-input shuffles). */
static inline v16 v16_sum16(const v16 *p) {
    v16 s1[8], s2[4], s3[2];
    for (int i = 0; i < 8; i++)
        s1[i] = __builtin_shuffle(p[i], p[i + 8], (vi16){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
                __builtin_shuffle(p[i], p[i + 8], (vi16){8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
    for (int i = 0; i < 4; i++)
        s2[i] = __builtin_shuffle(s1[i], s1[i + 4], (vi16){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
                __builtin_shuffle(s1[i], s1[i + 4], (vi16){4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
    for (int i = 0; i < 2; i++)
        s3[i] = __builtin_shuffle(s2[i], s2[i + 2], (vi16){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
                __builtin_shuffle(s2[i], s2[i + 2], (vi16){2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
    return __builtin_shuffle(s3[0], s3[1], (vi16){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
           __builtin_shuffle(s3[0], s3[1], (vi16){1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
}

static inline float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline float dot_kv(const float *a, const kv_t *b, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int j = 0; j < n; j++) s += a[j] * kv_get(b, j);
    return s;
}

/* out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, rows of n */
static void rmsnorm(float *out, const float *x, const float *w, int rows, int n, float eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        float *o = out + (size_t)r * n;
        float inv = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
#pragma omp simd
        for (int j = 0; j < n; j++) o[j] = xr[j] * inv * w[j];
    }
}

/* ------------------------------------------------------------------ matmul */

/* Pieces of a panel kernel: rows [0, MR) of a against one panel, c[r][0:nvalid] = a[r] . panel (+ bias)
   (+ res[r]); 2 MR accumulators of 16 columns stay in registers. While it streams the panel the kernel
   prefetches pf_lines cache lines from pf, spread evenly over its STEPS steps along K. */
#define PANEL_INIT(MR)                                                                            \
    v16 acc0[MR], acc1[MR];                                                                       \
    for (int r = 0; r < MR; r++) {                                                                \
        acc0[r] = (v16){0};                                                                       \
        acc1[r] = (v16){0};                                                                       \
    }                                                                                             \
    int due = 0;

#define PANEL_PREFETCH(STEPS) \
    for (due += pf_lines; due >= (STEPS); due -= (STEPS), pf += 64) __builtin_prefetch(pf, 0, 2);

#define PANEL_FMA(MR)                                                                             \
    for (int r = 0; r < MR; r++) {                                                                \
        float av = a[(size_t)r * lda + k];                                                        \
        acc0[r] += av * w0;                                                                       \
        acc1[r] += av * w1;                                                                       \
    }

#define PANEL_STORE(MR)                                                                           \
    for (int r = 0; r < MR; r++) {                                                                \
        v16 o0 = acc0[r], o1 = acc1[r];                                                           \
        if (bias) {                                                                               \
            o0 += *(const v16 *)bias;                                                             \
            o1 += *(const v16 *)(bias + 16);                                                      \
        }                                                                                         \
        float *cr = c + (size_t)r * ldc;                                                          \
        const float *rr = res ? res + (size_t)r * ldc : NULL;                                     \
        if (nvalid == NB) {                                                                       \
            if (rr) {                                                                             \
                o0 += *(const v16 *)rr;                                                           \
                o1 += *(const v16 *)(rr + 16);                                                    \
            }                                                                                     \
            *(v16 *)cr = o0;                                                                      \
            *(v16 *)(cr + 16) = o1;                                                               \
        } else {                                                                                  \
            float tmp[NB];                                                                        \
            *(v16 *)tmp = o0;                                                                     \
            *(v16 *)(tmp + 16) = o1;                                                              \
            for (int j = 0; j < nvalid; j++) cr[j] = tmp[j] + (rr ? rr[j] : 0.0f);                \
        }                                                                                         \
    }

#define MR_SWITCH(KERNEL)                   \
    switch (mr) {                           \
        case 1: KERNEL(1) break;            \
        case 2: KERNEL(2) break;            \
        case 3: KERNEL(3) break;            \
        case 4: KERNEL(4) break;            \
        case 5: KERNEL(5) break;            \
        case 6: KERNEL(6) break;            \
        case 7: KERNEL(7) break;            \
        case 8: KERNEL(8) break;            \
        case 9: KERNEL(9) break;            \
        case 10: KERNEL(10) break;          \
        case 11: KERNEL(11) break;          \
        case 12: KERNEL(12) break;          \
    }

/* fp32 panel [K][NB]: two vectors of 16 columns per k. */
#define PANEL_KERNEL_F32(MR)                                                                      \
    {                                                                                             \
        PANEL_INIT(MR)                                                                            \
        for (int k = 0; k < K; k++) {                                                             \
            PANEL_PREFETCH(K)                                                                     \
            v16 w0 = *(const v16 *)(w + (size_t)k * NB);                                          \
            v16 w1 = *(const v16 *)(w + (size_t)k * NB + 16);                                     \
            PANEL_FMA(MR)                                                                         \
        }                                                                                         \
        PANEL_STORE(MR)                                                                           \
    }

static void panel_rows(int mr, int K, const float *a, int lda, const float *w, const char *pf, int pf_lines,
                       float *c, int ldc, const float *bias, const float *res, int nvalid) {
    MR_SWITCH(PANEL_KERNEL_F32)
}

#ifdef NATIVE_BF16
#ifdef BF16_DOT
typedef uint16_t act_t; /* matmul activations: rounded to bf16 for vdpbf16ps */
#ifdef BF16_AMX
#define K_STORED(K) (((K) + 31) & ~31) /* weights and activations padded to whole tiles (16 pairs) along K */
#define M_STORED(M) (((M) + 15) & ~15) /* activation rows padded to whole tiles (16 rows, zeros) */
#else
#define K_STORED(K) (((K) + 1) & ~1) /* weights and activations padded to pairs along K */
#define M_STORED(M) (M)
#endif

/* bf16 panel [K/2][NB][2] (pairs along K), activations bf16 [MR][lda]: per pair of k, one vdpbf16ps per
   16 columns and row (two products per lane). */
#define PANEL_KERNEL_W(MR)                                                                        \
    {                                                                                             \
        PANEL_INIT(MR)                                                                            \
        const int steps = K_STORED(K) / 2;                                                        \
        for (int k = 0; k < steps; k++) {                                                         \
            PANEL_PREFETCH(steps)                                                                 \
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + (size_t)k * 2 * NB);                   \
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + (size_t)k * 2 * NB + NB);              \
            for (int r = 0; r < MR; r++) {                                                        \
                int32_t pair;                                                                     \
                memcpy(&pair, a + (size_t)r * lda + 2 * k, sizeof(pair));                         \
                __m512bh av = (__m512bh)_mm512_set1_epi32(pair);                                  \
                acc0[r] = (v16)_mm512_dpbf16_ps((__m512)acc0[r], av, w0);                         \
                acc1[r] = (v16)_mm512_dpbf16_ps((__m512)acc1[r], av, w1);                         \
            }                                                                                     \
        }                                                                                         \
        PANEL_STORE(MR)                                                                           \
    }
#else
typedef float act_t;
#define K_STORED(K) (K)
#define M_STORED(M) (M)

/* bf16 panel [K][NB], the 32 columns of a k interleaved (lane j of a 32-bit word: column j in its low half,
   column 16 + j in its high half), so one load and a shift / a mask widen them to two fp32 vectors. */
#define PANEL_KERNEL_W(MR)                                                                        \
    {                                                                                             \
        PANEL_INIT(MR)                                                                            \
        for (int k = 0; k < K; k++) {                                                             \
            PANEL_PREFETCH(K)                                                                     \
            vu16 raw = *(const vu16 *)(w + (size_t)k * NB);                                       \
            v16 w0 = (v16)(raw << 16), w1 = (v16)(raw & 0xffff0000u);                             \
            PANEL_FMA(MR)                                                                         \
        }                                                                                         \
        PANEL_STORE(MR)                                                                           \
    }
#endif

static void panel_rows_w(int mr, int K, const act_t *a, int lda, const wt *w, const char *pf, int pf_lines,
                         float *c, int ldc, const float *bias, const float *res, int nvalid) {
    MR_SWITCH(PANEL_KERNEL_W)
}

#ifdef BF16_AMX
#define AMX_ROWS 32 /* rows of a matmul block on tiles: C tiles 0-3 = rows 0-15 / 16-31 x columns 0-15 / 16-31 */

/* Linux hands out AMX tile state only on request (once per process); 1 if granted. */
static int amx_granted(void) {
    static int state = 0;
    if (state == 0) state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0 ? 1 : -1;
    return state > 0;
}

static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Rows [0, mr) (mr <= 32; a holds whole tiles of 16 rows) against one panel [K/2][NB][2] on AMX: per 32 k, A tiles
   4, 5 (16 rows x 32 k each), B tiles 6, 7 (16 pairs x 16 columns), four tdpbf16ps; then PANEL_STORE. */
static void panel_rows_amx(int mr, int K, const act_t *a, int lda, const wt *w, const char *pf, int pf_lines,
                           float *c, int ldc, const float *bias, const float *res, int nvalid) {
    const int steps = K_STORED(K) / 32, two = mr > 16;
    int due = 0;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < steps; k++) {
        PANEL_PREFETCH(steps)
        _tile_loadd(6, w + (size_t)k * 32 * NB, 2 * NB * sizeof(wt));
        _tile_loadd(7, w + (size_t)k * 32 * NB + NB, 2 * NB * sizeof(wt));
        _tile_loadd(4, a + (size_t)k * 32, lda * sizeof(act_t));
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (two) {
            _tile_loadd(5, a + (size_t)16 * lda + (size_t)k * 32, lda * sizeof(act_t));
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float tmp[AMX_ROWS * NB] __attribute__((aligned(64)));
    _tile_stored(0, tmp, NB * sizeof(float));
    _tile_stored(1, tmp + 16, NB * sizeof(float));
    _tile_stored(2, tmp + 16 * NB, NB * sizeof(float));
    _tile_stored(3, tmp + 16 * NB + 16, NB * sizeof(float));
    v16 acc0[AMX_ROWS], acc1[AMX_ROWS];
    for (int r = 0; r < mr; r++) {
        acc0[r] = *(const v16 *)(tmp + r * NB);
        acc1[r] = *(const v16 *)(tmp + r * NB + 16);
    }
    PANEL_STORE(mr)
}
#endif
#else
typedef float act_t;
#define K_STORED(K) (K)
#define M_STORED(M) (M)
#define panel_rows_w panel_rows
#endif

size_t packed_size(int N, int K) { return (size_t)panels_of(N) * K_STORED(K) * NB; }

/* 1 when this build's matmuls round the activations to bf16 before multiplying (vdpbf16ps, AMX), 0 when they
   multiply in fp32 (fp32 builds, and bf16 weights widened): what the path that runs does, for callers and tests. */
int matmul_rounds_activations(void) {
#ifdef BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* c[M][N] = a[M][K] w^T (+ bias) (+ res), w packed; res may be c itself (in-place residual add).
   While a thread works on panel p it prefetches panel p + PREFETCH_AHEAD into L2, spread evenly over
   the row blocks of panel p (a burst in the first block alone left memory idle in the others).
   With vdpbf16ps, a16 [threads][M][K_STORED(K)] is scratch for a rounded to bf16: each thread rounds all of a
   into its own copy (a few microseconds) rather than wait at a barrier for a shared one. */
#define PREFETCH_AHEAD 1
#define ROW_CHUNK (8 * MR_MAX)
static void matmul_into(int M, int N, int K, const float *a, const wt *w, const float *bias, const float *res,
                        float *c, act_t *a16) {
    const int panels = panels_of(N), lda = K_STORED(K);
    const size_t panel = (size_t)lda * NB;
    const int lines = (int)(panel * sizeof(wt) / 64);
#ifdef BF16_AMX
    const int amx = amx_granted(), rows = amx ? AMX_ROWS : MR_MAX;
#else
    const int rows = MR_MAX;
#endif
#pragma omp parallel
    {
#ifdef BF16_DOT
        act_t *mine = a16 + (size_t)omp_get_thread_num() * M_STORED(M) * lda;
        for (int r = 0; r < M_STORED(M); r++) {
            const float *ar = a + (size_t)r * K;
            act_t *o = mine + (size_t)r * lda;
            if (r >= M) {
                memset(o, 0, sizeof(act_t) * lda);
                continue;
            }
#pragma omp simd
            for (int k = 0; k < K; k++) o[k] = bf16_round(ar[k]);
            for (int k = K; k < lda; k++) o[k] = 0;
        }
        const act_t *ap = mine;
#else
        (void)a16;
        const act_t *ap = a;
#endif
#ifdef BF16_AMX
        if (amx) amx_configure();
#endif
        for (int m_lo = 0; m_lo < M; m_lo += ROW_CHUNK) { /* rows of a in chunks that stay in L2 */
            const int m_hi = M - m_lo < ROW_CHUNK ? M : m_lo + ROW_CHUNK;
            const int blocks = (m_hi - m_lo + rows - 1) / rows, per_block = lines / blocks;
#pragma omp for schedule(static) nowait
            for (int p = 0; p < panels; p++) {
                const wt *wp = w + (size_t)p * panel;
                const int ahead = p + PREFETCH_AHEAD < panels;
                const int nvalid = N - p * NB < NB ? N - p * NB : NB;
                for (int bi = 0; bi < blocks; bi++) {
                    int m0 = m_lo + bi * rows, mr = m_hi - m0 < rows ? m_hi - m0 : rows;
                    const char *pf = (const char *)(wp + PREFETCH_AHEAD * panel) + (size_t)bi * per_block * 64;
                    int pf_lines = !ahead ? 0 : (bi == blocks - 1 ? lines - bi * per_block : per_block);
#ifdef BF16_AMX
                    if (amx) {
                        panel_rows_amx(mr, K, ap + (size_t)m0 * lda, lda, wp, pf, pf_lines,
                                       c + (size_t)m0 * N + p * NB, N, bias ? bias + p * NB : NULL,
                                       res ? res + (size_t)m0 * N + p * NB : NULL, nvalid);
                        continue;
                    }
#endif
                    panel_rows_w(mr, K, ap + (size_t)m0 * lda, lda, wp, pf, pf_lines, c + (size_t)m0 * N + p * NB,
                                 N, bias ? bias + p * NB : NULL, res ? res + (size_t)m0 * N + p * NB : NULL, nvalid);
                }
            }
        }
#ifdef BF16_AMX
        if (amx) _tile_release();
#endif
    }
}

/* matmul_into with its own scratch; c is NaN if that cannot be allocated. */
void matmul(int M, int N, int K, const float *a, const wt *w, const float *bias, const float *res, float *c) {
    act_t *a16 = NULL;
#ifdef BF16_DOT
    a16 = malloc(sizeof(act_t) * (size_t)omp_get_max_threads() * M_STORED(M) * K_STORED(K));
    if (!a16) {
        for (size_t i = 0; i < (size_t)M * N; i++) c[i] = NAN;
        return;
    }
#endif
    matmul_into(M, N, K, a, w, bias, res, c, a16);
    free(a16);
}

/* w [N][K] row-major into panels of NB columns (columns past N are 0): fp32 [N/NB][K][NB]; bf16 the same
   with each k's columns interleaved (j, 16 + j), or with vdpbf16ps [N/NB][K/2][NB][2] (k past K is 0). */
void pack_weight(int N, int K, const wt *w, wt *packed) {
    int panels = panels_of(N);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K_STORED(K); k++)
            for (int j = 0; j < NB; j++) {
                int n = p * NB + j;
                wt v = n < N && k < K ? w[(size_t)n * K + k] : 0;
#if defined(BF16_DOT)
                packed[(((size_t)p * K_STORED(K) + (k & ~1)) * NB) + 2 * j + (k & 1)] = v;
#elif defined(NATIVE_BF16)
                packed[((size_t)p * K + k) * NB + (j < 16 ? 2 * j : 2 * (j - 16) + 1)] = v;
#else
                packed[((size_t)p * K + k) * NB + j] = v;
#endif
            }
}

/* ------------------------------------------------------------------ attention */

#define QUERY_CHUNK 4 /* most queries whose p.V accumulators stay in registers through a key block */

/* The keys and values of one kv head of one layer for one row: positions [bs i, bs (i + 1)) are in block
   table[i] of the pool, where the head's block_size keys (and values) are one contiguous run of rows of d. */
typedef struct {
    const kv_t *k, *v;   /* the layer's pool, offset to the kv head */
    size_t block_stride; /* values from one block to the next */
    const int32_t *table;
    int block_size, d;
} KVRow;

static inline size_t kv_offset(const KVRow *r, int t) {
    return (size_t)r->table[t / r->block_size] * r->block_stride + (size_t)(t % r->block_size) * r->d;
}

/* Keys from t on that are contiguous: up to the end of t's block and at most n (and t_end). */
static inline int kv_run(const KVRow *r, int t, int t_end, int n) {
    int run = r->block_size - t % r->block_size;
    run = run < n ? run : n;
    return run < t_end - t ? run : t_end - t;
}

/* A position t in a row's blocks (block index blk, offset off), advanced chunk by chunk without a division. */
typedef struct {
    int t, blk, off;
} KVCursor;

static inline KVCursor kv_cursor(const KVRow *r, int t) { return (KVCursor){t, t / r->block_size, t % r->block_size}; }

static inline size_t kv_at(const KVRow *r, KVCursor c) {
    return (size_t)r->table[c.blk] * r->block_stride + (size_t)c.off * r->d;
}

/* Keys of the chunk at c: at most 16, inside c's block, before t_end (0 past the end). */
static inline int kv_chunk(const KVRow *r, KVCursor c, int t_end) {
    int n = t_end - c.t < 16 ? t_end - c.t : 16;
    n = n < r->block_size - c.off ? n : r->block_size - c.off;
    return n > 0 ? n : 0;
}

static inline KVCursor kv_next(const KVRow *r, KVCursor c, int n) {
    c.t += n;
    c.off += n;
    if (c.off == r->block_size) {
        c.blk++;
        c.off = 0;
    }
    return c;
}

#define KV_PREFETCH_AHEAD 2 /* chunks of keys (and values) prefetched ahead of the one attended */

/* Scores of one query (head_dim 16 * DV) against a block of 16 fp32 keys kb [16][d]: one vector, lane t = key t. */
static inline __attribute__((always_inline)) v16 block_scores(const int DV, const float *qi, const float *kb) {
    v16 qv[8], part[16];
    for (int c = 0; c < DV; c++) qv[c] = *(const v16 *)(qi + 16 * c);
    for (int t = 0; t < 16; t++) {
        v16 sum = qv[0] * *(const v16 *)(kb + (size_t)t * 16 * DV);
        for (int c = 1; c < DV; c++) sum += qv[c] * *(const v16 *)(kb + (size_t)t * 16 * DV + 16 * c);
        part[t] = sum;
    }
    return v16_sum16(part);
}

/* acc[i] += sum over t < nt of p[i * qs + t * ks] * v[t] for NC queries, the accumulators in registers;
   on the way the key and value rows of the pf_n keys at pf_k / pf_v (the next keys to attend) are prefetched. */
static inline __attribute__((always_inline)) void pv_chunk(const int DV, const int NC, const float *p, const int qs,
                                                           const int ks, const kv_t *vb, int nt, float *acc,
                                                           const kv_t *pf_k, const kv_t *pf_v, int pf_n) {
    v16 o[QUERY_CHUNK][8];
    for (int i = 0; i < NC; i++)
        for (int c = 0; c < DV; c++) o[i][c] = *(const v16 *)(acc + (size_t)i * 16 * DV + 16 * c);
    for (int t = 0; t < nt; t++) {
        if (t < pf_n) /* the next keys' key and value rows, one each per key of this block */
            for (int c = 0; c < DV; c++) {
                __builtin_prefetch(pf_k + (size_t)t * 16 * DV + 16 * c, 0, 3);
                __builtin_prefetch(pf_v + (size_t)t * 16 * DV + 16 * c, 0, 3);
            }
        v16 vt[8];
        for (int c = 0; c < DV; c++) vt[c] = kv_load16(vb + (size_t)t * 16 * DV + 16 * c);
        for (int i = 0; i < NC; i++) {
            const float pt = p[i * qs + t * ks];
            for (int c = 0; c < DV; c++) o[i][c] += pt * vt[c];
        }
    }
    for (int i = 0; i < NC; i++)
        for (int c = 0; c < DV; c++) *(v16 *)(acc + (size_t)i * 16 * DV + 16 * c) = o[i][c];
}

/* pv_chunk over all nq queries, QUERY_CHUNK at a time (the first chunk prefetches the next keys). */
static inline __attribute__((always_inline)) void pv_all(const int DV, int nq, const float *p, const int qs,
                                                         const int ks, const kv_t *vb, int nt, float *acc,
                                                         const kv_t *pf_k, const kv_t *pf_v, int pf_n) {
    int i0 = 0;
    for (; i0 + QUERY_CHUNK <= nq; i0 += QUERY_CHUNK, pf_n = 0)
        pv_chunk(DV, QUERY_CHUNK, p + i0 * qs, qs, ks, vb, nt, acc + (size_t)i0 * 16 * DV, pf_k, pf_v, pf_n);
    switch (nq - i0) {
        case 1: pv_chunk(DV, 1, p + i0 * qs, qs, ks, vb, nt, acc + (size_t)i0 * 16 * DV, pf_k, pf_v, pf_n); break;
        case 2: pv_chunk(DV, 2, p + i0 * qs, qs, ks, vb, nt, acc + (size_t)i0 * 16 * DV, pf_k, pf_v, pf_n); break;
        case 3: pv_chunk(DV, 3, p + i0 * qs, qs, ks, vb, nt, acc + (size_t)i0 * 16 * DV, pf_k, pf_v, pf_n); break;
    }
}

/* attend_keys for head_dim = 16 * DV: each chunk of up to 16 keys (never across a block boundary) gives a
   query one vector of 16 scores (v16_sum16 of its partial products), the softmax runs on that vector, and
   p.V accumulates with up to QUERY_CHUNK queries' outputs in registers; the next chunk's keys and values
   are prefetched meanwhile. A chunk of fewer than 16 keys is copied into a zero-padded buffer first (no read
   past the block, no garbage in the scores). bf16 keys are widened into that buffer once per chunk, not once
   per query (the same fp32 values, so the same scores). */
static inline __attribute__((always_inline)) void attend_keys_v(const int DV, const float *q, int nq,
                                                                const KVRow *row, int t0, int t1, float *m,
                                                                float *l, float *acc, float *scores) {
    const int d = 16 * DV;
    float pad_k[16 * 16 * 8] __attribute__((aligned(64)));
    KVCursor cur = kv_cursor(row, t0), pf = cur;
    for (int i = 1; i < KV_PREFETCH_AHEAD; i++) { /* the chunks before the loop's first prefetch: asked for now */
        pf = kv_next(row, pf, kv_chunk(row, pf, t1));
        const int n = kv_chunk(row, pf, t1);
        const size_t at = n ? kv_at(row, pf) : 0;
        for (int t = 0; t < n; t++)
            for (int c = 0; c < DV; c++) {
                __builtin_prefetch(row->k + at + (size_t)t * d + 16 * c, 0, 3);
                __builtin_prefetch(row->v + at + (size_t)t * d + 16 * c, 0, 3);
            }
    }
    for (int nb; (nb = kv_chunk(row, cur, t1)) > 0; cur = kv_next(row, cur, nb)) {
        const size_t at = kv_at(row, cur);
        const kv_t *vb = row->v + at;
        pf = kv_next(row, pf, kv_chunk(row, pf, t1)); /* KV_PREFETCH_AHEAD chunks ahead: prefetched during p.V */
        const int pf_n = kv_chunk(row, pf, t1);
        const size_t pf_at = pf_n ? kv_at(row, pf) : 0;
#ifdef NATIVE_BF16
        for (int x = 0; x < nb * d; x += 16) *(v16 *)(pad_k + x) = kv_load16(row->k + at + x);
        const float *kb = pad_k;
#else
        const float *kb = row->k + at;
        if (nb < 16) {
            memcpy(pad_k, kb, sizeof(float) * nb * d);
            kb = pad_k;
        }
#endif
        if (nb < 16) memset(pad_k + nb * d, 0, sizeof(float) * (16 - nb) * d);
        const vi16 valid = (vi16){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} < nb;
        for (int i = 0; i < nq; i++) {
            v16 sc = v16_select(valid, block_scores(DV, q + (size_t)i * d, kb), v16_splat(-INFINITY));
            float top = v16_max_lane(sc);
            if (top > m[i]) {
                float corr = m[i] == -INFINITY ? 0.0f : exp_f32(m[i] - top);
                l[i] *= corr;
                for (int c = 0; c < DV; c++) *(v16 *)(acc + (size_t)i * d + 16 * c) *= corr;
                m[i] = top;
            }
            v16 pr = v16_select(valid, v16_exp(sc - m[i]), (v16){0});
            l[i] += v16_sum_lanes(pr);
            *(v16 *)(scores + 16 * i) = pr;
        }
        pv_all(DV, nq, scores, 16, 1, vb, nb, acc, row->k + pf_at, row->v + pf_at, pf_n);
    }
}

/* Online-softmax state of one query: running max m, sum l, unnormalised output acc[d]. */
static void attend_keys_scalar(const float *q, int nq, int d, const KVRow *row, int t0, int t1, float *m, float *l,
                               float *acc, float *scores) {
    for (int b0 = t0; b0 < t1; b0 += KEY_BLOCK) {
        int nb = t1 - b0 < KEY_BLOCK ? t1 - b0 : KEY_BLOCK;
        for (int t = 0; t < nb; t++) {
            const kv_t *kt = row->k + kv_offset(row, b0 + t);
            for (int i = 0; i < nq; i++) scores[i * KEY_BLOCK + t] = dot_kv(q + (size_t)i * d, kt, d);
        }
        for (int i = 0; i < nq; i++) {
            float *s = scores + i * KEY_BLOCK;
            float top = m[i];
            for (int t = 0; t < nb; t++) top = s[t] > top ? s[t] : top;
            float *o = acc + (size_t)i * d;
            if (top > m[i]) {
                float corr = m[i] == -INFINITY ? 0.0f : exp_f32(m[i] - top);
                l[i] *= corr;
#pragma omp simd
                for (int j = 0; j < d; j++) o[j] *= corr;
                m[i] = top;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int t = 0; t < nb; t++) {
                s[t] = exp_f32(s[t] - top);
                sum += s[t];
            }
            l[i] += sum;
            for (int t = 0; t < nb; t++) {
                const kv_t *vt = row->v + kv_offset(row, b0 + t);
                float pt = s[t];
#pragma omp simd
                for (int j = 0; j < d; j++) o[j] += pt * kv_get(vt, j);
            }
        }
    }
}

/* n K values as fp32: the pool itself in fp32, else widened into buf. */
#ifdef NATIVE_BF16
#define NATIVE_BF16_KF (MR_MAX * 128)
static inline const float *kv_rows_f32(const kv_t *k, int n, float *buf) {
    widen_row(buf, k, n);
    return buf;
}
#else
#define NATIVE_BF16_KF 1
static inline const float *kv_rows_f32(const kv_t *k, int n, float *buf) {
    (void)n;
    (void)buf;
    return k;
}
#endif

#define WIDE_MIN 8    /* queries from which a shared prefix is attended with the queries across the lanes */
#define WIDE_KEYS 48  /* keys per online-softmax step of the wide path */

/* attend_keys for 8..32 queries over keys [0, t1) that they all share (a GRPO group's prefix blocks), head_dim
   16 * DV: the queries go across the lanes instead of the keys. Scores of a step's keys are small matmuls
   (keys as rows, in runs inside one block, the queries packed as one 32-column panel: the weight matmul's
   kernel), so the softmax's max, exp and sum run lane-wise over keys with no shuffles, and p.V is as in the
   narrow path, run by run, the next step's keys and values prefetched meanwhile. */
static inline __attribute__((always_inline)) void attend_keys_wide(const int DV, const float *q, int nq,
                                                                   const KVRow *row, int t1, float *m, float *l,
                                                                   float *acc) {
    const int d = 16 * DV;
    float qp[16 * 8 * 32] __attribute__((aligned(64))), sc[WIDE_KEYS * 32] __attribute__((aligned(64)));
    float kf[NATIVE_BF16_KF] __attribute__((aligned(64))); /* a run of bf16 keys widened (fp32: unused) */
    for (int j = 0; j < d; j++)
        for (int i = 0; i < 32; i++) qp[32 * j + i] = i < nq ? q[(size_t)i * d + j] : 0.0f;
    v16 mv[2], lv[2];
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 16; i++) {
            int k = 16 * h + i;
            mv[h][i] = k < nq ? m[k] : -INFINITY;
            lv[h][i] = k < nq ? l[k] : 0.0f;
        }
    for (int b0 = 0; b0 < t1; b0 += WIDE_KEYS) {
        const int nt = t1 - b0 < WIDE_KEYS ? t1 - b0 : WIDE_KEYS;
        for (int r0 = 0, run; r0 < nt; r0 += run) {
            run = kv_run(row, b0 + r0, b0 + nt, MR_MAX);
            panel_rows(run, d, kv_rows_f32(row->k + kv_offset(row, b0 + r0), run * d, kf), d, qp, NULL, 0, sc + 32 * r0,
                       32, NULL, NULL, 32);
        }
        v16 corr[2];
        for (int h = 0; h < 2; h++) {
            v16 top = mv[h];
            for (int t = 0; t < nt; t++) top = v16_max(top, *(const v16 *)(sc + 32 * t + 16 * h));
            /* a lane whose running max was -inf has nothing to rescale (its sum and output are 0) */
            corr[h] = v16_select(mv[h] == v16_splat(-INFINITY), (v16){0}, v16_exp(mv[h] - top));
            v16 sum = (v16){0};
            for (int t = 0; t < nt; t++) {
                v16 pt = v16_exp(*(const v16 *)(sc + 32 * t + 16 * h) - top);
                *(v16 *)(sc + 32 * t + 16 * h) = pt;
                sum += pt;
            }
            lv[h] = lv[h] * corr[h] + sum;
            mv[h] = top;
        }
        for (int i = 0; i < nq; i++) {
            const float ci = corr[i / 16][i % 16];
            if (ci != 1.0f)
                for (int c = 0; c < DV; c++) *(v16 *)(acc + (size_t)i * d + 16 * c) *= ci;
        }
        const int n1 = t1 - b0 - nt < WIDE_KEYS ? t1 : b0 + nt + WIDE_KEYS; /* the next step's keys: [b0 + nt, n1) */
        for (int r0 = 0, run, pf_t = b0 + nt; r0 < nt; r0 += run) {
            const int t = b0 + r0;
            run = kv_run(row, t, b0 + nt, nt);
            /* while this run's p.V goes, the next step's keys and values come in, run by run */
            const int pf_n = pf_t < n1 ? kv_run(row, pf_t, n1, run) : 0;
            const size_t pf_at = pf_n ? kv_offset(row, pf_t) : 0;
            pv_all(DV, nq, sc + 32 * r0, 1, 32, row->v + kv_offset(row, t), run, acc, row->k + pf_at,
                   row->v + pf_at, pf_n);
            pf_t += pf_n;
        }
    }
    for (int i = 0; i < nq; i++) {
        m[i] = mv[i / 16][i % 16];
        l[i] = lv[i / 16][i % 16];
    }
}

/* Fold keys [t0, t1) of a row into the online-softmax state (m, l, acc) of nq queries q [nq][d]; scores: scratch. */
static void attend_keys(const float *q, int nq, int d, const KVRow *row, int t0, int t1, float *m, float *l,
                        float *acc, float *scores) {
    if (t0 == 0 && nq >= WIDE_MIN && nq <= 32 && d % 16 == 0 && d <= 128) {
        switch (d / 16) {
            case 1: attend_keys_wide(1, q, nq, row, t1, m, l, acc); return;
            case 2: attend_keys_wide(2, q, nq, row, t1, m, l, acc); return;
            case 3: attend_keys_wide(3, q, nq, row, t1, m, l, acc); return;
            case 4: attend_keys_wide(4, q, nq, row, t1, m, l, acc); return;
            case 5: attend_keys_wide(5, q, nq, row, t1, m, l, acc); return;
            case 6: attend_keys_wide(6, q, nq, row, t1, m, l, acc); return;
            case 7: attend_keys_wide(7, q, nq, row, t1, m, l, acc); return;
            case 8: attend_keys_wide(8, q, nq, row, t1, m, l, acc); return;
        }
    }
    switch (d % 16 ? 0 : d / 16) {
        case 1: attend_keys_v(1, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 2: attend_keys_v(2, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 3: attend_keys_v(3, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 4: attend_keys_v(4, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 5: attend_keys_v(5, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 6: attend_keys_v(6, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 7: attend_keys_v(7, q, nq, row, t0, t1, m, l, acc, scores); break;
        case 8: attend_keys_v(8, q, nq, row, t0, t1, m, l, acc, scores); break;
        default: attend_keys_scalar(q, nq, d, row, t0, t1, m, l, acc, scores);
    }
}

/* Floats from one block of a layer's pool to the next, and from one layer's pool to the next. */
static inline size_t block_stride(const Model *m) { return (size_t)m->num_kv_heads * m->block_size * m->head_dim; }
static inline size_t layer_stride(const Model *m) { return (size_t)(m->num_blocks + 1) * block_stride(m); }

/* attn[row][head*d] for every row: q in qkv (already scaled by 1/sqrt(d)), K/V of this layer in the blocks of
   each row's table (tables [B][width]). A segment's shared prefix [0, P) is read through its first row's table:
   its rows hold the same blocks there. */
static int attention(const Model *m, int layer, const float *qkv, const int64_t *positions, const int32_t *tables,
                     int width, int num_segments, const int32_t *seg_start, const int32_t *seg_rows,
                     const int32_t *seg_prefix, float *attn) {
    const int d = m->head_dim, H = m->num_heads, KH = m->num_kv_heads, G = H / KH;
    const int qkv_n = (H + 2 * KH) * d;
    const size_t head_stride = (size_t)m->block_size * d, layer_off = (size_t)layer * layer_stride(m);
    const kv_t *kc = m->k_cache + layer_off, *vc = m->v_cache + layer_off;
    int max_rows = 1;
    for (int s = 0; s < num_segments; s++)
        if (seg_start[s + 1] - seg_start[s] > max_rows) max_rows = seg_start[s + 1] - seg_start[s];
    const int max_q = max_rows * G;
    int failed = 0;
#pragma omp parallel
    {
        /* q [max_q][d], acc [max_q][d], scores [max_q][KEY_BLOCK], running max [max_q], sum [max_q] */
        float *q = malloc(sizeof(float) * (size_t)max_q * (2 * d + KEY_BLOCK + 2));
        float *acc = q + (size_t)max_q * d, *scores = acc + (size_t)max_q * d;
        float *mx = scores + (size_t)max_q * KEY_BLOCK, *l = mx + max_q;
        if (!q) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_segments * KH; task++) {
            if (!q) continue;
            int s = task / KH, h = task % KH;
            const int32_t *rows = seg_rows + seg_start[s];
            int nrows = seg_start[s + 1] - seg_start[s], nq = nrows * G, P = seg_prefix[s];
            KVRow kv = {kc + h * head_stride, vc + h * head_stride, block_stride(m), NULL, m->block_size, d};
            for (int r = 0; r < nrows; r++)
                memcpy(q + (size_t)r * G * d, qkv + (size_t)rows[r] * qkv_n + (size_t)h * G * d, sizeof(float) * G * d);
            for (int i = 0; i < nq; i++) {
                mx[i] = -INFINITY;
                l[i] = 0.0f;
            }
            memset(acc, 0, sizeof(float) * (size_t)nq * d);
            if (P > 0) {
                kv.table = tables + (size_t)rows[0] * width;
                attend_keys(q, nq, d, &kv, 0, P, mx, l, acc, scores);
            }
            for (int r = 0; r < nrows; r++) {
                kv.table = tables + (size_t)rows[r] * width;
                attend_keys(q + (size_t)r * G * d, G, d, &kv, P, (int)positions[rows[r]] + 1, mx + r * G, l + r * G,
                            acc + (size_t)r * G * d, scores);
            }
            for (int r = 0; r < nrows; r++) {
                float *o = attn + (size_t)rows[r] * H * d + (size_t)h * G * d;
                for (int g = 0; g < G; g++) {
                    float inv = 1.0f / l[r * G + g];
                    const float *a = acc + (size_t)(r * G + g) * d;
#pragma omp simd
                    for (int j = 0; j < d; j++) o[g * d + j] = a[j] * inv;
                }
            }
        }
        free(q);
    }
    return failed ? -1 : 0;
}

/* ------------------------------------------------------------------ the step */

/* Per-head RMSNorm (Qwen3, optional), RoPE on the q and k heads of each row of qkv (in place), q scaled by
   1/sqrt(d) if scale_q; each row's k and v written into the pool at its KV slot (block * block_size + offset). */
static void qk_rope_store(const Model *m, int layer, float *qkv, int B, const int64_t *positions,
                          const int64_t *kv_slots, int scale_q) {
    const int d = m->head_dim, H = m->num_heads, KH = m->num_kv_heads, half = d / 2, bs = m->block_size;
    const int qkv_n = (H + 2 * KH) * d;
    const size_t head_stride = (size_t)bs * d, layer_off = (size_t)layer * layer_stride(m);
    const float *qn = m->q_norm ? m->q_norm[layer] : NULL, *kn = m->k_norm ? m->k_norm[layer] : NULL;
    const float scale = scale_q ? 1.0f / sqrtf((float)d) : 1.0f;
#pragma omp parallel for schedule(static) if (B >= 64)
    for (int b = 0; b < B; b++) {
        float tmp[1024];
        float *row = qkv + (size_t)b * qkv_n;
        const float *cs = m->cos + (size_t)positions[b] * d, *sn = m->sin_signed + (size_t)positions[b] * d;
        const size_t slot_at = layer_off + (size_t)(kv_slots[b] / bs) * block_stride(m) + (size_t)(kv_slots[b] % bs) * d;
        for (int h = 0; h < H + KH; h++) {
            float *x = row + (size_t)h * d;
            const float *nw = h < H ? qn : kn;
            if (nw) rmsnorm(x, x, nw, 1, d, m->eps);
            memcpy(tmp, x, sizeof(float) * d);
            for (int j = 0; j < d; j++) x[j] = tmp[j] * cs[j] + tmp[j < half ? j + half : j - half] * sn[j];
            if (h < H) {
                if (scale_q)
#pragma omp simd
                    for (int j = 0; j < d; j++) x[j] *= scale;
            } else {
                size_t at = slot_at + (size_t)(h - H) * head_stride;
                kv_store(m->k_cache + at, x, d);
                kv_store(m->v_cache + at, row + (size_t)(H + KH + h - H) * d, d);
            }
        }
    }
}

/* ------------------------------------------------------------------ prefill pieces
   The prefill keeps oneDNN's matmuls (faster at hundreds of rows) and torch's causal attention;
   these replace its elementwise passes. */

/* qk_rope_store for the new tokens of a prefill (q left unscaled: SDPA scales it). */
void rope_store(const Model *m, int layer, float *qkv, int M, const int64_t *positions, const int64_t *kv_slots) {
    qk_rope_store(m, layer, qkv, M, positions, kv_slots, 0);
}

void rmsnorm_rows(float *out, const float *x, const float *w, int rows, int n, float eps) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int r = 0; r < rows; r++) rmsnorm(out + (size_t)r * n, x + (size_t)r * n, w, 1, n, eps);
}

/* out[M][I] = silu(gu[:, :I]) * gu[:, I:] */
void silu_mul(float *out, const float *gu, int M, int I) {
#pragma omp parallel for schedule(static) if (M >= 64)
    for (int r = 0; r < M; r++) {
        const float *g = gu + (size_t)r * 2 * I, *u = g + I;
        float *a = out + (size_t)r * I;
#pragma omp simd
        for (int j = 0; j < I; j++) a[j] = g[j] / (1.0f + exp_f32(-g[j])) * u[j];
    }
}

/* Decode one token per row; logits [B][vocab]. Row b's token goes to position positions[b] in the blocks of its
   table (tables [B][width], padded with any block id). Segments: see the file comment (every row in exactly one).
   Returns 0, or -1 if a work buffer could not be allocated or head_dim is out of range. */
int decode_step(const Model *m, int B, const int64_t *tokens, const int64_t *positions, const int32_t *tables,
                int width, int num_segments, const int32_t *seg_start, const int32_t *seg_rows,
                const int32_t *seg_prefix, float *logits) {
    const int hid = m->hidden, d = m->head_dim, H = m->num_heads, KH = m->num_kv_heads, I = m->inter;
    const int qkv_n = (H + 2 * KH) * d, bs = m->block_size;
    if (d > 1024) return -1;
    size_t per_row = (size_t)2 * hid + qkv_n + H * d + 2 * I + I;
    float *work = malloc(sizeof(float) * per_row * B);
    int64_t *kv_slots = malloc(sizeof(int64_t) * B);
    act_t *a16 = NULL; /* the matmuls' activations in bf16 (vdpbf16ps only), [threads][B][the widest K] */
    int a16_ok = 1;
#ifdef BF16_DOT
    const int widest = hid > H * d ? (hid > I ? hid : I) : (H * d > I ? H * d : I);
    a16 = malloc(sizeof(act_t) * (size_t)omp_get_max_threads() * M_STORED(B) * K_STORED(widest));
    a16_ok = a16 != NULL;
#endif
    if (!work || !kv_slots || !a16_ok) {
        free(work);
        free(kv_slots);
        free(a16);
        return -1;
    }
    float *x = work, *h = x + (size_t)B * hid, *qkv = h + (size_t)B * hid, *attn = qkv + (size_t)B * qkv_n;
    float *gu = attn + (size_t)B * H * d, *act = gu + (size_t)B * 2 * I;
    for (int b = 0; b < B; b++)
        kv_slots[b] = (int64_t)tables[(size_t)b * width + positions[b] / bs] * bs + positions[b] % bs;
    PHASE_START
    for (int b = 0; b < B; b++) widen_row(x + (size_t)b * hid, m->embed + (size_t)tokens[b] * hid, hid);
    int rc = 0;
    for (int layer = 0; layer < m->num_layers && rc == 0; layer++) {
        rmsnorm(h, x, m->in_norm[layer], B, hid, m->eps);
        PHASE(0)
        matmul_into(B, qkv_n, hid, h, m->qkv_w[layer], m->qkv_b ? m->qkv_b[layer] : NULL, NULL, qkv, a16);
        PHASE(1)
        qk_rope_store(m, layer, qkv, B, positions, kv_slots, 1);
        PHASE(2)
        rc = attention(m, layer, qkv, positions, tables, width, num_segments, seg_start, seg_rows, seg_prefix, attn);
        PHASE(3)
        matmul_into(B, hid, H * d, attn, m->o_w[layer], m->o_b ? m->o_b[layer] : NULL, x, x, a16);
        PHASE(1)
        rmsnorm(h, x, m->post_norm[layer], B, hid, m->eps);
        PHASE(0)
        matmul_into(B, 2 * I, hid, h, m->gate_up_w[layer], m->gate_up_b ? m->gate_up_b[layer] : NULL, NULL, gu, a16);
        PHASE(1)
        silu_mul(act, gu, B, I);
        PHASE(4)
        matmul_into(B, hid, I, act, m->down_w[layer], m->down_b ? m->down_b[layer] : NULL, x, x, a16);
        PHASE(1)
    }
    if (rc == 0) {
        rmsnorm(h, x, m->final_norm, B, hid, m->eps);
        PHASE(0)
        matmul_into(B, m->vocab, hid, h, m->lm_head, NULL, NULL, logits, a16);
        PHASE(5)
    }
    free(work);
    free(kv_slots);
    free(a16);
    return rc;
}

/* ------------------------------------------------------------------ sampling */

#define DRAW_BLOCK 256 /* tokens per block of the inverse-CDF draw (sampling.py's DRAW_BLOCK) */

/* Plain sampling (temperature only) of B rows of logits [B][V]: x = z / T, e = exp(x - max x);
   token = the first index whose running sum of e exceeds u * sum(e) (found block by block, then
   inside the block; a rounding that finds none takes the block's most likely token), logprob =
   x[token] - max x - log(sum e): sampling.py's plain-row draw and reported logprob, one read of the
   row for the max and one for the sums. ok[b] = 0 when row b has no finite mass (NaN / inf logits). */
void sample_plain(int B, int V, const float *logits, const float *temps, const float *u, int64_t *tokens,
                  float *logprobs, int32_t *ok) {
#pragma omp parallel for schedule(static)
    for (int b = 0; b < B; b++) {
        const float *z = logits + (size_t)b * V;
        const float t = temps[b];
        const int unit = t == 1.0f; /* x = z exactly, as the torch path, which divides only when some T is not 1 */
        const int nblocks = (V + DRAW_BLOCK - 1) / DRAW_BLOCK;
        float sums[(V + DRAW_BLOCK - 1) / DRAW_BLOCK];
        v16 vtop = v16_splat(-INFINITY);
        vi16 bad = (vi16){0};
        int i = 0;
        for (; i + 16 <= V; i += 16) {
            v16 x = *(const v16 *)(z + i);
            if (!unit) x = x / t;
            bad |= ~(x < INFINITY); /* NaN or +inf */
            vtop = v16_max(vtop, x);
        }
        float top = v16_max_lane(vtop);
        int finite = 1;
        for (int j = 0; j < 16; j++) finite &= !bad[j];
        for (; i < V; i++) {
            float x = unit ? z[i] : z[i] / t;
            if (!(x < INFINITY)) finite = 0;
            top = x > top ? x : top;
        }
        float total = 0.0f;
        for (int k = 0; k < nblocks && finite && top > -INFINITY; k++) {
            const int lo = k * DRAW_BLOCK, hi = lo + DRAW_BLOCK < V ? lo + DRAW_BLOCK : V;
            float s = 0.0f;
            if (hi - lo == DRAW_BLOCK) {
                v16 acc = (v16){0};
                for (int i = lo; i < hi; i += 16) {
                    v16 x = *(const v16 *)(z + i);
                    if (!unit) x = x / t;
                    acc += v16_exp(x - top);
                }
                s = v16_sum_lanes(acc);
            } else {
                for (int i = lo; i < hi; i++) s += exp_f32((unit ? z[i] : z[i] / t) - top);
            }
            sums[k] = s;
            total += s;
        }
        if (!finite || !(total > 0.0f) || !(total < INFINITY)) {
            ok[b] = 0;
            tokens[b] = 0;
            logprobs[b] = 0.0f;
            continue;
        }
        const float target = u[b] * total;
        float before = 0.0f;
        int k = 0;
        for (; k < nblocks - 1 && before + sums[k] <= target; k++) before += sums[k];
        while (k > 0 && sums[k] == 0.0f) before -= sums[--k]; /* a rounding past the mass: the last block with some */
        const int lo = k * DRAW_BLOCK, hi = lo + DRAW_BLOCK < V ? lo + DRAW_BLOCK : V;
        int token = -1, best = lo;
        float cum = before, best_x = -INFINITY;
        for (int i = lo; i < hi; i++) {
            float x = unit ? z[i] : z[i] / t;
            if (x > best_x) {
                best_x = x;
                best = i;
            }
            float p = exp_f32(x - top);
            cum += p;
            if (token < 0 && cum > target && p > 0.0f) token = i;
        }
        if (token < 0) token = best;
        tokens[b] = token;
        logprobs[b] = (unit ? z[token] : z[token] / t) - top - logf(total);
        ok[b] = 1;
    }
}
