/* localdiff: the routed experts' gated FFN in bf16 for x86 CPUs (Python side: localdiff/kernels/experts.py).
 *
 * For each expert e with rows (token t, slot j) routed to it (sorted by expert: `order`, group ends `ends`):
 *   a = gelu_tanh(x_t · Wg_eᵀ) * (x_t · Wu_eᵀ) * w_tj          (gate_up_e = [Wg; Wu]: bf16 [2I, H], fp32 sums)
 *   ys[t·K + j] = bf16(a) · Wd_eᵀ                              (down_e: bf16 [H, I], fp32 sums, bf16 result)
 * then out[t] = bf16(Σ_j ys[t·K + j]) (fp32 sum of the K slots). The activation a stays fp32 until it is rounded
 * once to bf16 as the down product's operand (the torch path rounds the gate/up products, the GELU, the product
 * and the weighting to bf16 each); gelu_tanh(g) = g / (1 + exp(-2·√(2/π)·(g + 0.044715 g³))) (the same function as
 * torch's tanh-approximate GELU), exp by a degree-6 polynomial after range reduction (relative error ~1e-6).
 *
 * Layout: the weights are used as stored; each 16-channel block of an expert's weight is the left operand A
 * (16 rows x 32 k per step), the expert's rows the right operand B in the pair layout of the bf16 dot products
 * (B[k/2][row][2]: rows packed once per expert and 16-row tile), C = [16 channels][16 rows] in fp32. Every weight
 * byte is read once per call for up to 32 rows of an expert (more rows: another pass, from cache); only real rows
 * are computed, padded to 16 per tile. K tails (H or I not a multiple of 32) and channel tails (not a multiple of
 * 16) use zero-padded copies of the weight block, so nothing outside the tensors is read.
 * Two paths on these layouts: AMX-BF16 tiles (tdpbf16ps; Linux grants the tile state on ARCH_REQ_XCOMP_PERM) and
 * AVX512-BF16 (vdpbf16ps emulating the tile product: one zmm accumulator per channel; compute-bound, measured
 * slower than torch's AMX GEMMs, so the Python side runs it only when forced). Built without
 * AVX512-BF16, localdiff_experts_has() reports 0 and the caller keeps its torch kernel.
 * Threads: experts are split into `threads` contiguous ranges, then tokens for the sum over slots (pthreads per
 * call; the caller's thread runs the first range).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define HAVE_BF16 1
#include <immintrin.h>
#endif
#if defined(HAVE_BF16) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#ifndef PF_DIST
#define PF_DIST 4                           /* weight prefetch distance in 32-k steps */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#define MAX_THREADS 256
#define RB 32                               /* rows of an expert per pass over its weights (two 16-row tiles) */

#ifdef HAVE_BF16
typedef struct {
    const uint16_t *x, *gu, *dn;
    const int64_t *order, *ends;
    const float *rw;
    uint16_t *ys, *out;
    long N, H, I, E, K, b0, b1;
    int amx, rc;
} job_t;

static int amx_state;                       /* 0 = not asked, 1 = granted, -1 = refused or not built */
static pthread_mutex_t amx_lock = PTHREAD_MUTEX_INITIALIZER;

static int amx_ok(void) {
#ifdef HAVE_AMX
    pthread_mutex_lock(&amx_lock);
    if (amx_state == 0)                     /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    pthread_mutex_unlock(&amx_lock);
    return amx_state == 1;
#else
    return 0;
#endif
}

static inline __mmask16 mask16(long n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
static inline __mmask32 mask32(long n) { return n >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)((1u << n) - 1); }

static inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147181f));   /* |f| <= ln2 / 2 */
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static inline __m512 gelu_tanh(__m512 g) {
    __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
    __m512 z = _mm512_fmadd_ps(g3, _mm512_set1_ps(0.044715f), g);
    __m512 e = exp512(_mm512_mul_ps(z, _mm512_set1_ps(-1.59576912f)));              /* -2 sqrt(2 / pi) */
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

/* The 16 x 32 weight block at w (row stride ld elements; `rows` valid rows, `kn` valid k): w itself when whole,
 * else a zero-padded copy in buf. */
static inline const uint16_t *a_block(const uint16_t *w, long ld, int rows, long kn, uint16_t *buf, long *lda) {
    if (rows == 16 && kn >= 32) {
        *lda = ld;
        return w;
    }
    for (int i = 0; i < 16; i++)
        _mm512_storeu_si512(buf + 32 * i, i < rows ? _mm512_maskz_loadu_epi16(mask32(kn), w + i * ld)
                                                   : _mm512_setzero_si512());
    *lda = 32;
    return buf;
}

/* Prefetch the 16 rows' k-step PF_DIST ahead of k, past the rows' end the next 16 rows' first steps (a prefetch never
 * faults: past the tensor's end it is harmless). */
static inline void prefetch_ahead(const uint16_t *w, long ld, long k, long K, long kpad) {
    long kk = k + 32 * PF_DIST;
    const uint16_t *p = kk < K ? w + kk : w + 16 * ld + (kk - kpad);
    for (int i = 0; i < 16; i++) _mm_prefetch((const char *)(p + i * ld), PF_HINT);
}

/* C[t][16][16] = A (16 weight rows from w, row stride ld, `rows` valid, K valid k) x B[t] (pair layout, kp-major:
 * B[t] + kp * 16 uint32), t < T; kpad = K rounded up to 32. */
static void block_product(int amx, const uint16_t *w, long ld, int rows, long K, long kpad, const uint32_t *const *B,
                          int T, float C[2][16][16]) {
    uint16_t buf[16 * 32] __attribute__((aligned(64)));
    long lda;
#ifdef HAVE_AMX
    if (amx) {
        _tile_zero(0);
        _tile_zero(1);
        for (long k = 0; k < kpad; k += 32) {
            prefetch_ahead(w, ld, k, K, kpad);
            const uint16_t *a = a_block(w + k, ld, rows, K - k, buf, &lda);
            _tile_loadd(4, a, 2 * lda);
            _tile_loadd(6, B[0] + k / 2 * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (T > 1) {
                _tile_loadd(7, B[1] + k / 2 * 16, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
        }
        _tile_stored(0, C[0], 64);
        if (T > 1) _tile_stored(1, C[1], 64);
        return;
    }
#endif
    (void)amx;
    for (int t = 0; t < T; t++) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (long k = 0; k < kpad; k += 32) {
            if (t == 0) prefetch_ahead(w, ld, k, K, kpad);
            const uint16_t *a = a_block(w + k, ld, rows, K - k, buf, &lda);
            for (int kp = 0; kp < 16; kp++) {
                __m512bh bv = (__m512bh)_mm512_loadu_si512(B[t] + (k / 2 + kp) * 16);
                for (int i = 0; i < 16; i++) {
                    uint32_t pair;
                    memcpy(&pair, a + i * lda + 2 * kp, 4);
                    acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)pair), bv);
                }
            }
        }
        for (int i = 0; i < 16; i++) _mm512_storeu_ps(C[t][i], acc[i]);
    }
}

/* Rows r0 .. r0 + n (n <= 32) of expert e. Scratch: xb [2][H32 / 2][16] uint32, db [2][I32 / 2][16] uint32,
 * stage [16][H32] bf16. */
static void expert_rows(const job_t *j, long e, long r0, int n, uint32_t *xb, uint32_t *db, uint16_t *stage) {
    const long H = j->H, I = j->I, H32 = (H + 31) / 32 * 32, I32 = (I + 31) / 32 * 32;
    const int T = (n + 15) / 16;
    const uint16_t *gu = j->gu + e * 2 * I * H, *dn = j->dn + e * H * I;
    const uint32_t *Bx[2] = {xb, xb + H32 / 2 * 16}, *Bd[2] = {db, db + I32 / 2 * 16};
    long flat[RB];
    float wv[2][16] __attribute__((aligned(64)));
    float C[2][2][16][16] __attribute__((aligned(64)));
    memset(wv, 0, sizeof wv);
    /* B of the up/gate product: row m's element pair kp at xb[t][kp][m] (zeros past n rows and past H): the rows
     * copied into a zero-padded [16][H32] stage, then 16 rows' pair kp gathered at once */
    const __m512i rowoff = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                              _mm512_set1_epi32((int)(H32 / 2)));
    for (int t = 0; t < T; t++) {
        for (int m = 0; m < 16; m++) {
            int r = 16 * t + m;
            uint16_t *row = stage + m * H32;
            if (r < n) {
                flat[r] = j->order[r0 + r];
                wv[t][m] = j->rw[flat[r]];
                memcpy(row, j->x + flat[r] / j->K * H, sizeof(uint16_t) * H);
                memset(row + H, 0, sizeof(uint16_t) * (H32 - H));
            } else {
                memset(row, 0, sizeof(uint16_t) * H32);
            }
        }
        uint32_t *dst = xb + t * (H32 / 2 * 16);
        for (long kp = 0; kp < H32 / 2; kp++)
            _mm512_storeu_si512(dst + kp * 16, _mm512_i32gather_epi32(_mm512_add_epi32(rowoff, _mm512_set1_epi32(
                (int)kp)), (const void *)stage, 4));
    }
    memset(db, 0, sizeof(uint32_t) * 2 * (I32 / 2) * 16);
    for (long c0 = 0; c0 < I; c0 += 16) {
        int rows = I - c0 < 16 ? (int)(I - c0) : 16;
        block_product(j->amx, gu + c0 * H, H, rows, H, H32, Bx, T, C[0]);
        block_product(j->amx, gu + (I + c0) * H, H, rows, H, H32, Bx, T, C[1]);
        for (int t = 0; t < T; t++) {
            __m512 w = _mm512_load_ps(wv[t]);
            for (int i = 0; i < rows; i += 2) {         /* channel pair (c0 + i, c0 + i + 1) → B[t][(c0 + i) / 2] */
                __m512 a0 = _mm512_mul_ps(_mm512_mul_ps(gelu_tanh(_mm512_load_ps(C[0][t][i])),
                                                        _mm512_load_ps(C[1][t][i])), w);
                __m512 a1 = i + 1 < rows ? _mm512_mul_ps(_mm512_mul_ps(gelu_tanh(_mm512_load_ps(C[0][t][i + 1])),
                                                                       _mm512_load_ps(C[1][t][i + 1])), w)
                                         : _mm512_setzero_ps();
                __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a0));
                __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a1)), 16);
                _mm512_storeu_si512(db + t * (I32 / 2 * 16) + (c0 + i) / 2 * 16, _mm512_or_si512(lo, hi));
            }
        }
    }
    const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    for (long h0 = 0; h0 < H; h0 += 16) {
        int rows = H - h0 < 16 ? (int)(H - h0) : 16;
        block_product(j->amx, dn + h0 * I, I, rows, I, I32, Bd, T, C[0]);
        for (int r = 0; r < n; r++) {                    /* C[t][h][m] → ys[flat][h0 + h] */
            __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(col, _mm512_set1_epi32(r % 16)), &C[0][r / 16][0][0], 4);
            _mm256_mask_storeu_epi16(j->ys + flat[r] * H + h0, mask16(rows), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

static void run_experts(job_t *j) {
    const long H32 = (j->H + 31) / 32 * 32, I32 = (j->I + 31) / 32 * 32;
    uint32_t *xb = aligned_alloc(64, sizeof(uint32_t) * 2 * (H32 / 2) * 16);
    uint32_t *db = aligned_alloc(64, sizeof(uint32_t) * 2 * (I32 / 2) * 16);
    uint16_t *stage = aligned_alloc(64, sizeof(uint16_t) * 16 * H32);
    if (!xb || !db || !stage) {
        free(xb);
        free(db);
        free(stage);
        j->rc = -1;
        return;
    }
#ifdef HAVE_AMX
    if (j->amx) {
        struct {
            uint8_t palette, start_row, reserved[14];
            uint16_t colsb[16];
            uint8_t rows[16];
        } __attribute__((packed)) cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
        _tile_loadconfig(&cfg);
    }
#endif
    for (long e = j->b0; e < j->b1; e++) {
        long start = e ? j->ends[e - 1] : 0;
        for (long r = start; r < j->ends[e]; r += RB)
            expert_rows(j, e, r, j->ends[e] - r < RB ? (int)(j->ends[e] - r) : RB, xb, db, stage);
    }
#ifdef HAVE_AMX
    if (j->amx) _tile_release();
#endif
    free(xb);
    free(db);
    free(stage);
}

static void run_sum(job_t *j) {                         /* out[t] = bf16(sum_s ys[t * K + s]) for t in b0 .. b1 */
    const long H = j->H, K = j->K;
    for (long t = j->b0; t < j->b1; t++)
        for (long h = 0; h < H; h += 16) {
            __mmask16 m = mask16(H - h);
            __m512 acc = _mm512_setzero_ps();
            for (long s = 0; s < K; s++)
                acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, j->ys + (t * K + s) * H + h)), 16)));
            _mm256_mask_storeu_epi16(j->out + t * H + h, m, (__m256i)_mm512_cvtneps_pbh(acc));
        }
}

static void *thread_experts(void *a) { run_experts((job_t *)a); return NULL; }
static void *thread_sum(void *a) { run_sum((job_t *)a); return NULL; }

static int parallel(job_t *base, long total, int threads, void *(*fn)(void *)) {
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0, rc = 0;
    long per = (total + threads - 1) / threads;
    for (long b = 0; b < total && nj < MAX_THREADS; b += per) {
        jobs[nj] = *base;
        jobs[nj].b0 = b;
        jobs[nj].b1 = b + per < total ? b + per : total;
        nj++;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, fn, &jobs[i]) == 0;
    if (nj > 0) fn(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else fn(&jobs[i]);
    }
    for (int i = 0; i < nj; i++) rc = jobs[i].rc ? jobs[i].rc : rc;
    return rc;
}
#endif

/* Which path this build and process can run: 2 = AMX-BF16, 1 = AVX512-BF16 only, 0 = none. */
int localdiff_experts_has(void) {
#ifdef HAVE_BF16
    return amx_ok() ? 2 : 1;
#else
    return 0;
#endif
}

/* The MoE experts (header). x: bf16 [N, H] (contiguous); order: int64 [N * K], the flat (token * K + slot) index of
 * each row sorted by expert; ends: int64 [E], the end of each expert's rows in `order` (cumulative counts); rw: fp32
 * [N * K] routing weight by flat index; gate_up: bf16 [E, 2I, H]; down: bf16 [E, H, I]; ys: bf16 [N * K, H] scratch;
 * out: bf16 [N, H]. use_amx: 1 to take the AMX path where granted. Returns 0; -1 when memory ran out; -2 when this
 * build has no bf16 path (nothing written). */
int localdiff_experts_bf16(const uint16_t *x, long N, long H, long I, long E, long K, const int64_t *order,
                           const int64_t *ends, const float *rw, const uint16_t *gate_up, const uint16_t *down,
                           uint16_t *ys, uint16_t *out, int use_amx, int threads) {
#ifdef HAVE_BF16
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    job_t base = {x, gate_up, down, order, ends, rw, ys, out, N, H, I, E, K, 0, 0, use_amx && amx_ok(), 0};
    int rc = parallel(&base, E, threads, thread_experts);
    if (rc) return rc;
    return parallel(&base, N, threads, thread_sum);
#else
    (void)x; (void)N; (void)H; (void)I; (void)E; (void)K; (void)order; (void)ends; (void)rw; (void)gate_up;
    (void)down; (void)ys; (void)out; (void)use_amx; (void)threads;
    return -2;
#endif
}
