/* One decode step of the lean forward (Llama / Qwen2 / Qwen3) on CPU in fp32, in a single call.

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

   Also here: the plain-row sampler (sample_plain) and the prefill's elementwise passes (rope_store,
   rmsnorm_rows, silu_mul); the prefill's matmuls and attention stay torch's. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

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
    const float *const *in_norm, *const *post_norm;                              /* [layers] -> [hidden] */
    const float *const *qkv_w, *const *o_w, *const *gate_up_w, *const *down_w;  /* packed (pack_weight) */
    const float *const *qkv_b, *const *o_b, *const *gate_up_b, *const *down_b;  /* padded to panels, or NULL */
    const float *const *q_norm, *const *k_norm;                                  /* [head_dim] (Qwen3), or NULL */
    float *k_cache, *v_cache;       /* the block pool: [layers][num_blocks + 1][kv_heads][block_size][head_dim] */
    const float *embed;             /* [vocab][hidden], plain */
    const float *final_norm;        /* [hidden] */
    const float *lm_head;           /* packed */
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

/* Rows [0, MR) of a, one panel: c[r][0:nvalid] = a[r] . panel (+ bias) (+ res[r]) */
#define PANEL_KERNEL(MR)                                                                          \
    {                                                                                             \
        v16 acc0[MR], acc1[MR];                                                                   \
        for (int r = 0; r < MR; r++) {                                                            \
            acc0[r] = (v16){0};                                                                   \
            acc1[r] = (v16){0};                                                                   \
        }                                                                                         \
        int due = 0;                                                                              \
        for (int k = 0; k < K; k++) {                                                             \
            for (due += pf_lines; due >= K; due -= K, pf += 16) __builtin_prefetch(pf, 0, 2);     \
            v16 w0 = *(const v16 *)(w + (size_t)k * NB);                                          \
            v16 w1 = *(const v16 *)(w + (size_t)k * NB + 16);                                     \
            for (int r = 0; r < MR; r++) {                                                        \
                float av = a[(size_t)r * lda + k];                                                \
                acc0[r] += av * w0;                                                               \
                acc1[r] += av * w1;                                                               \
            }                                                                                     \
        }                                                                                         \
        for (int r = 0; r < MR; r++) {                                                            \
            v16 o0 = acc0[r], o1 = acc1[r];                                                       \
            if (bias) {                                                                           \
                o0 += *(const v16 *)bias;                                                         \
                o1 += *(const v16 *)(bias + 16);                                                  \
            }                                                                                     \
            float *cr = c + (size_t)r * ldc;                                                      \
            const float *rr = res ? res + (size_t)r * ldc : NULL;                                 \
            if (nvalid == NB) {                                                                   \
                if (rr) {                                                                         \
                    o0 += *(const v16 *)rr;                                                       \
                    o1 += *(const v16 *)(rr + 16);                                                \
                }                                                                                 \
                *(v16 *)cr = o0;                                                                  \
                *(v16 *)(cr + 16) = o1;                                                           \
            } else {                                                                              \
                float tmp[NB];                                                                    \
                *(v16 *)tmp = o0;                                                                 \
                *(v16 *)(tmp + 16) = o1;                                                          \
                for (int j = 0; j < nvalid; j++) cr[j] = tmp[j] + (rr ? rr[j] : 0.0f);            \
            }                                                                                     \
        }                                                                                         \
    }

static void panel_rows(int mr, int K, const float *a, int lda, const float *w, const float *pf, int pf_lines,
                       float *c, int ldc, const float *bias, const float *res, int nvalid) {
    switch (mr) {
        case 1: PANEL_KERNEL(1) break;
        case 2: PANEL_KERNEL(2) break;
        case 3: PANEL_KERNEL(3) break;
        case 4: PANEL_KERNEL(4) break;
        case 5: PANEL_KERNEL(5) break;
        case 6: PANEL_KERNEL(6) break;
        case 7: PANEL_KERNEL(7) break;
        case 8: PANEL_KERNEL(8) break;
        case 9: PANEL_KERNEL(9) break;
        case 10: PANEL_KERNEL(10) break;
        case 11: PANEL_KERNEL(11) break;
        case 12: PANEL_KERNEL(12) break;
    }
}

/* c[M][N] = a[M][K] w^T (+ bias) (+ res), w packed; res may be c itself (in-place residual add).
   While a thread works on panel p it prefetches panel p + PREFETCH_AHEAD into L2, spread evenly over
   the row blocks of panel p (a burst in the first block alone left memory idle in the others). */
#define PREFETCH_AHEAD 1
#define ROW_CHUNK (8 * MR_MAX)
void matmul(int M, int N, int K, const float *a, const float *w, const float *bias, const float *res, float *c) {
    const int panels = panels_of(N);
    const size_t panel = (size_t)K * NB;
    const int lines = (int)(panel / 16);
#pragma omp parallel
    for (int m_lo = 0; m_lo < M; m_lo += ROW_CHUNK) { /* rows of a in chunks that stay in L2 */
        const int m_hi = M - m_lo < ROW_CHUNK ? M : m_lo + ROW_CHUNK;
        const int blocks = (m_hi - m_lo + MR_MAX - 1) / MR_MAX, per_block = lines / blocks;
#pragma omp for schedule(static) nowait
        for (int p = 0; p < panels; p++) {
            const float *wp = w + (size_t)p * panel;
            const int ahead = p + PREFETCH_AHEAD < panels;
            const int nvalid = N - p * NB < NB ? N - p * NB : NB;
            for (int bi = 0; bi < blocks; bi++) {
                int m0 = m_lo + bi * MR_MAX, mr = m_hi - m0 < MR_MAX ? m_hi - m0 : MR_MAX;
                const float *pf = wp + PREFETCH_AHEAD * panel + (size_t)bi * per_block * 16;
                int pf_lines = !ahead ? 0 : (bi == blocks - 1 ? lines - bi * per_block : per_block);
                panel_rows(mr, K, a + (size_t)m0 * K, K, wp, pf, pf_lines, c + (size_t)m0 * N + p * NB, N,
                           bias ? bias + p * NB : NULL, res ? res + (size_t)m0 * N + p * NB : NULL, nvalid);
            }
        }
    }
}

/* w [N][K] row-major into panels [ceil(N/NB)][K][NB] (columns past N are 0). */
void pack_weight(int N, int K, const float *w, float *packed) {
    int panels = panels_of(N);
#pragma omp parallel for schedule(static)
    for (int p = 0; p < panels; p++)
        for (int k = 0; k < K; k++)
            for (int j = 0; j < NB; j++) {
                int n = p * NB + j;
                packed[((size_t)p * K + k) * NB + j] = n < N ? w[(size_t)n * K + k] : 0.0f;
            }
}

size_t packed_size(int N, int K) { return (size_t)panels_of(N) * K * NB; }

/* ------------------------------------------------------------------ attention */

#define QUERY_CHUNK 4 /* most queries whose p.V accumulators stay in registers through a key block */

/* The keys and values of one kv head of one layer for one row: positions [bs i, bs (i + 1)) are in block
   table[i] of the pool, where the head's block_size keys (and values) are one contiguous run of rows of d. */
typedef struct {
    const float *k, *v;  /* the layer's pool, offset to the kv head */
    size_t block_stride; /* floats from one block to the next */
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

/* Scores of one query (head_dim 16 * DV) against a block of 16 keys kb [16][d]: one vector, lane t = key t. */
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
                                                           const int ks, const float *vb, int nt, float *acc,
                                                           const float *pf_k, const float *pf_v, int pf_n) {
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
        for (int c = 0; c < DV; c++) vt[c] = *(const v16 *)(vb + (size_t)t * 16 * DV + 16 * c);
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
                                                         const int ks, const float *vb, int nt, float *acc,
                                                         const float *pf_k, const float *pf_v, int pf_n) {
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
   past the block, no garbage in the scores). */
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
        const float *kb = row->k + at, *vb = row->v + at;
        pf = kv_next(row, pf, kv_chunk(row, pf, t1)); /* KV_PREFETCH_AHEAD chunks ahead: prefetched during p.V */
        const int pf_n = kv_chunk(row, pf, t1);
        const size_t pf_at = pf_n ? kv_at(row, pf) : 0;
        if (nb < 16) {
            memcpy(pad_k, kb, sizeof(float) * nb * d);
            memset(pad_k + nb * d, 0, sizeof(float) * (16 - nb) * d);
            kb = pad_k;
        }
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
            const float *kt = row->k + kv_offset(row, b0 + t);
            for (int i = 0; i < nq; i++) scores[i * KEY_BLOCK + t] = dot(q + (size_t)i * d, kt, d);
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
                const float *vt = row->v + kv_offset(row, b0 + t);
                float pt = s[t];
#pragma omp simd
                for (int j = 0; j < d; j++) o[j] += pt * vt[j];
            }
        }
    }
}

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
            panel_rows(run, d, row->k + kv_offset(row, b0 + r0), d, qp, NULL, 0, sc + 32 * r0, 32, NULL, NULL, 32);
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
    const float *kc = m->k_cache + layer_off, *vc = m->v_cache + layer_off;
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
                memcpy(m->k_cache + at, x, sizeof(float) * d);
                memcpy(m->v_cache + at, row + (size_t)(H + KH + h - H) * d, sizeof(float) * d);
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
    if (!work || !kv_slots) {
        free(work);
        free(kv_slots);
        return -1;
    }
    float *x = work, *h = x + (size_t)B * hid, *qkv = h + (size_t)B * hid, *attn = qkv + (size_t)B * qkv_n;
    float *gu = attn + (size_t)B * H * d, *act = gu + (size_t)B * 2 * I;
    for (int b = 0; b < B; b++)
        kv_slots[b] = (int64_t)tables[(size_t)b * width + positions[b] / bs] * bs + positions[b] % bs;
    PHASE_START
    for (int b = 0; b < B; b++) memcpy(x + (size_t)b * hid, m->embed + (size_t)tokens[b] * hid, sizeof(float) * hid);
    int rc = 0;
    for (int layer = 0; layer < m->num_layers && rc == 0; layer++) {
        rmsnorm(h, x, m->in_norm[layer], B, hid, m->eps);
        PHASE(0)
        matmul(B, qkv_n, hid, h, m->qkv_w[layer], m->qkv_b ? m->qkv_b[layer] : NULL, NULL, qkv);
        PHASE(1)
        qk_rope_store(m, layer, qkv, B, positions, kv_slots, 1);
        PHASE(2)
        rc = attention(m, layer, qkv, positions, tables, width, num_segments, seg_start, seg_rows, seg_prefix, attn);
        PHASE(3)
        matmul(B, hid, H * d, attn, m->o_w[layer], m->o_b ? m->o_b[layer] : NULL, x, x);
        PHASE(1)
        rmsnorm(h, x, m->post_norm[layer], B, hid, m->eps);
        PHASE(0)
        matmul(B, 2 * I, hid, h, m->gate_up_w[layer], m->gate_up_b ? m->gate_up_b[layer] : NULL, NULL, gu);
        PHASE(1)
        silu_mul(act, gu, B, I);
        PHASE(4)
        matmul(B, hid, I, act, m->down_w[layer], m->down_b ? m->down_b[layer] : NULL, x, x);
        PHASE(1)
    }
    if (rc == 0) {
        rmsnorm(h, x, m->final_norm, B, hid, m->eps);
        PHASE(0)
        matmul(B, m->vocab, hid, h, m->lm_head, NULL, NULL, logits);
        PHASE(5)
    }
    free(work);
    free(kv_slots);
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
