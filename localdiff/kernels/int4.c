/* localdiff: weight-only int4 matmul for CPUs, y[m, n] = sum_k x[m, k] * s[n, g(k)] * (q[n, k] - z[n, g(k)]).
 *
 * Format (localdiff/quantize/int4.py): groups of 64 input features; q: uint8 [N, Kp / 2] (Kp = 64 * G), byte i of
 * group g holds k = 64g + i (low nibble) and k = 64g + 32 + i (high nibble); scale: bf16 bits [N, G]; zero: fp16
 * bits [N, G]. x: [M, Kp] (row stride ldx), zero past the true K (the Python side pads it). y: fp32 [M, N].
 * Python side: localdiff/kernels/int4.py.
 *
 * Two paths, both streaming the 0.5625 bytes per weight once per call (R output rows at a time; every row of x is
 * applied while they are in L1):
 * - localdiff_int4_mm with bf16 x on a CPU with AVX512-BF16 (Zen 4, Sapphire Rapids; built with -march=native):
 *   the 64 codes of a group become two vectors of 32 exact bf16 integers 0..15 (one vpmovzxbw + a vpermw table
 *   lookup per nibble), vdpbf16ps sums x * q exactly-multiplied into fp32 lanes (32 products per instruction, half
 *   the instructions of fp32 FMAs), and one FMA per group applies the group's scale. The zero point enters once per
 *   group and row as s * z * sum(x over the group) (the group sums of x are computed once per call).
 * - fp32 FMAs everywhere else (fp32 x, or bf16 x cast to fp32 by the caller): each group's codes are dequantized in
 *   registers, w = q * s + (-z * s), and multiplied with every row of x by fused multiply-adds. Plain C with GCC /
 *   Clang vector extensions: zmm on AVX-512, ymm on AVX2 (intrinsics only for the code unpacking), and any other
 *   target builds too (generic C: the compiler splits or scalarises the vectors).
 * Neither quantizes activations: the result is dequantize(q, s, z) @ x^T up to fp32 summation order.
 * Threads: N is split into `threads` contiguous ranges (pthreads created per call; the caller runs the first).
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VW 16
#define ACC_BUDGET 16
#define RMAX 4
#else
#define VW 8
#define ACC_BUDGET 8
#define RMAX 2
#endif
#define GROUP 64
#define GBYTES 32
#define MT_MAX 8
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_BF16 1
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef uint8_t vb __attribute__((vector_size(VW)));

static inline float bf16_f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float f16_f(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, u;
    if (e == 0x1F) u = s | 0x7F800000u | (m << 13);
    else if (e != 0) u = s | ((e + 112u) << 23) | (m << 13);
    else {                                         /* zero or subnormal: m * 2^-24 */
        float f = (float)m * 5.9604644775390625e-8f;
        return s ? -f : f;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
#endif
}

/* VW codes from VW bytes at p: the low nibbles (hi = 0) or the high ones (hi = 1), as floats. */
static inline vf load_codes(const uint8_t *p, const int hi) {
#if defined(__AVX512F__)
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    if (hi) v = _mm512_srli_epi32(v, 4);
    return (vf)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
#elif defined(__AVX2__)
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    if (hi) v = _mm256_srli_epi32(v, 4);
    return (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    vi v = __builtin_convertvector(b, vi);
    if (hi) v = v >> 4;
    return __builtin_convertvector(v & 15, vf);
#endif
}

static inline vf load_x(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Prefetch this tile's share of the next R rows while group g of this tile runs: rows of a tile are contiguous, so
 * the next rows are the R * G * 32 bytes right after them, and group g takes bytes [g, g + 1) * R * 32 of them. The
 * hardware prefetchers stop at each 4 KiB page, and a tile of 4 rows at K = 2048 is one page: without this every
 * tile started on cold lines (a prefetch past the weights' end never faults). */
static inline void prefetch_next(const uint8_t *next, long g, const int R) {
    const uint8_t *p = next + g * R * GBYTES;
    for (int i = 0; i < R * GBYTES; i += 64) __builtin_prefetch(p + i, 0, 3);
    if (R * GBYTES < 64 && (g & 1) == 0) __builtin_prefetch(p, 0, 3);
}

typedef struct {
    const void *x;
    long ldx, M, G;
    const float *xsum;                     /* [M][G] group sums of x (bf16 path) */
    const uint8_t *q;
    const uint16_t *s, *z;
    void *y;                               /* fp32, or bf16 bits when y_bf16 */
    long ldy, n_begin, n_end;
    int bf16, y_bf16;
} job_t;

/* y[i] = v: fp32, or rounded to bf16 as torch's fp32 -> bf16 cast does (to nearest, ties to even; NaN -> 0x7FC0). */
static inline void store_y(const job_t *j, long i, float v) {
    if (!j->y_bf16) {
        ((float *)j->y)[i] = v;
        return;
    }
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = 0x7FC00000u;
    else u += 0x7FFFu + ((u >> 16) & 1u);
    ((uint16_t *)j->y)[i] = (uint16_t)(u >> 16);
}


/* The R rows' per-group fp32 scales sb[r][g] and biases bb[r][g] = -z * s (FMA path), or, for the bf16 path, the
 * zero-point terms zt[m][r] = sum_g s * z * xsum[m][g] (bb unused then). */
static inline __attribute__((always_inline)) void row_consts(const job_t *j, long m0, long n0, const int MT,
                                                            const int R, float *sb, float *bb,
                                                            float zt[MT_MAX][RMAX]) {
    const long G = j->G;
    for (int r = 0; r < R; r++) {
        const uint16_t *s = j->s + (n0 + r) * G, *z = j->z + (n0 + r) * G;
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX512BW__) && defined(__AVX512VL__)
        __m512 zv[MT_MAX];
        for (int m = 0; m < MT; m++) zv[m] = _mm512_setzero_ps();
        for (long g = 0; g < G; g += 16) {
            const __mmask16 mk = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
            __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, s + g)), 16));
            __m512 zf = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, z + g));
            _mm512_mask_storeu_ps(sb + r * G + g, mk, sv);
            if (bb) _mm512_mask_storeu_ps(bb + r * G + g, mk, _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), zf), sv));
            if (zt) {
                __m512 sz = _mm512_mul_ps(sv, zf);
                for (int m = 0; m < MT; m++)
                    zv[m] = _mm512_fmadd_ps(sz, _mm512_maskz_loadu_ps(mk, j->xsum + (m0 + m) * G + g), zv[m]);
            }
        }
        if (zt)
            for (int m = 0; m < MT; m++) zt[m][r] = _mm512_reduce_add_ps(zv[m]);
#else
        for (int m = 0; m < MT; m++) if (zt) zt[m][r] = 0.0f;
        for (long g = 0; g < G; g++) {
            const float sc = bf16_f(s[g]), zf = f16_f(z[g]);
            sb[r * G + g] = sc;
            if (bb) bb[r * G + g] = -zf * sc;
            if (zt)
                for (int m = 0; m < MT; m++) zt[m][r] += sc * zf * j->xsum[(m0 + m) * G + g];
        }
#endif
    }
}

/* fp32 FMA tile: MT rows of x times R rows of q (MT, R compile-time after inlining). */
static inline __attribute__((always_inline)) void tile_fma(const job_t *j, long m0, long n0, const int MT,
                                                          const int R) {
    const long G = j->G, ldq = G * GBYTES, ldx = j->ldx;
    const float *x = (const float *)j->x + m0 * ldx;
    const uint8_t *q = j->q + n0 * ldq;
    vf acc[MT_MAX][RMAX];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m][r] = (vf){0};
    float sb[RMAX * G], bb[RMAX * G];
    row_consts(j, m0, n0, MT, R, sb, bb, NULL);
    for (long g = 0; g < G; g++) {
        vf sv[RMAX], bv[RMAX];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) sv[r] = (vf){0} + sb[r * G + g], bv[r] = (vf){0} + bb[r * G + g];
        const uint8_t *qg = q + g * GBYTES;
        if (m0 == 0) prefetch_next(q + R * ldq, g, R);
#pragma GCC unroll 8
        for (int c = 0; c < GROUP / VW; c++) {
            vf w[RMAX];
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                w[r] = load_codes(qg + r * ldq + (c * VW) % GBYTES, c * VW >= GBYTES) * sv[r] + bv[r];
#pragma GCC unroll 8
            for (int m = 0; m < MT; m++) {
                vf xv = load_x(x + m * ldx + g * GROUP + c * VW);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) acc[m][r] += xv * w[r];
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float t = 0.0f;
            for (int l = 0; l < VW; l++) t += acc[m][r][l];
            store_y(j, (m0 + m) * j->ldy + n0 + r, t);
        }
}

#ifdef HAVE_BF16
/* bf16 of 0..15, indexed by the low 5 bits of a word (vpermw): entry i = bf16(i & 15) */
static const uint16_t BF16_CODES[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

/* AVX512-BF16 tile: y = sum_g s * (x . q)_g - s * z * xsum_g (see the header). */
static inline __attribute__((always_inline)) void tile_bf16(const job_t *j, long m0, long n0, const int MT,
                                                           const int R) {
    const long G = j->G, ldq = G * GBYTES, ldx = j->ldx;
    const uint16_t *x = (const uint16_t *)j->x + m0 * ldx;
    const uint8_t *q = j->q + n0 * ldq;
    const __m512i table = _mm512_loadu_si512((const void *)BF16_CODES);
    __m512 acc[MT_MAX][RMAX];
    float zacc[MT_MAX][RMAX], sb[RMAX * G];
    row_consts(j, m0, n0, MT, R, sb, NULL, zacc);
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (long g = 0; g < G; g++) {
        __m512i wlo[RMAX], whi[RMAX];
        if (m0 == 0) prefetch_next(q + R * ldq, g, R);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            __m512i wide = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + r * ldq + g * GBYTES)));
            wlo[r] = _mm512_permutexvar_epi16(wide, table);
            whi[r] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wide, 4), table);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            const __m512i xlo = _mm512_loadu_si512((const void *)(x + m * ldx + g * GROUP));
            const __m512i xhi = _mm512_loadu_si512((const void *)(x + m * ldx + g * GROUP + 32));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512 ga = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)xlo, (__m512bh)wlo[r]);
                ga = _mm512_dpbf16_ps(ga, (__m512bh)xhi, (__m512bh)whi[r]);
                acc[m][r] = _mm512_fmadd_ps(ga, _mm512_set1_ps(sb[r * G + g]), acc[m][r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            store_y(j, (m0 + m) * j->ldy + n0 + r, _mm512_reduce_add_ps(acc[m][r]) - zacc[m][r]);
}
#endif

typedef void (*tile_fn)(const job_t *, long, long);

#ifdef HAVE_BF16
#define TILE_FN(MT, R)                                                                                           \
    static void tf_##MT##_##R(const job_t *j, long m0, long n0) { tile_fma(j, m0, n0, MT, R); }                 \
    static void tb_##MT##_##R(const job_t *j, long m0, long n0) { tile_bf16(j, m0, n0, MT, R); }
#define TILE_B(MT) {tb_##MT##_1, tb_##MT##_2, tb_##MT##_4}
#else
#define TILE_FN(MT, R)                                                                                           \
    static void tf_##MT##_##R(const job_t *j, long m0, long n0) { tile_fma(j, m0, n0, MT, R); }
#endif
#if RMAX == 4
#define TILE_ROW(MT) TILE_FN(MT, 1) TILE_FN(MT, 2) TILE_FN(MT, 4)
#define TILE_F(MT) {tf_##MT##_1, tf_##MT##_2, tf_##MT##_4}
#else
#define TILE_ROW(MT) TILE_FN(MT, 1) TILE_FN(MT, 2)
#define TILE_F(MT) {tf_##MT##_1, tf_##MT##_2, tf_##MT##_2}
#endif
TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5) TILE_ROW(6) TILE_ROW(7) TILE_ROW(8)
static const tile_fn TILES_F[MT_MAX][3] = {TILE_F(1), TILE_F(2), TILE_F(3), TILE_F(4),
                                           TILE_F(5), TILE_F(6), TILE_F(7), TILE_F(8)};
#ifdef HAVE_BF16
static const tile_fn TILES_B[MT_MAX][3] = {TILE_B(1), TILE_B(2), TILE_B(3), TILE_B(4),
                                           TILE_B(5), TILE_B(6), TILE_B(7), TILE_B(8)};
#endif

/* Output rows per block for mt rows of x: the largest of RMAX, .., 1 keeping mt * r accumulators in budget. */
static int rows_for(int mt) {
    int r = RMAX;
    while (r > 1 && mt * r > ACC_BUDGET) r /= 2;
    return r;
}

static void run_range(const job_t *j) {
    const tile_fn(*tiles)[3] = TILES_F;
#ifdef HAVE_BF16
    if (j->bf16) tiles = TILES_B;
#endif
    int mt_main = j->M < MT_MAX ? (int)j->M : MT_MAX;
    int R = rows_for(mt_main);
    while (j->M == 1 && R > 1 && R * j->G * GBYTES > 4096) R /= 2;   /* 1 row: tiles of at most 4 KiB of weight */
    for (long n = j->n_begin; n < j->n_end; n += R) {
        int r = R;
        while (n + r > j->n_end) r /= 2;           /* the range's last rows: smaller blocks */
        for (long m0 = 0; m0 < j->M; m0 += MT_MAX) {
            int mt = j->M - m0 < MT_MAX ? (int)(j->M - m0) : MT_MAX;
            int rr = r;
            while (mt * rr > ACC_BUDGET && rr > 1) rr /= 2;
            for (int off = 0; off < r; off += rr) tiles[mt - 1][rr == 4 ? 2 : rr == 2 ? 1 : 0](j, m0, n + off);
        }
        R = r;                                     /* stay on the smaller block size to the end */
    }
}

static void *thread_main(void *arg) {
    run_range((const job_t *)arg);
    return NULL;
}

#define MAX_THREADS 256

/* 1 when bf16 activations run the AVX512-BF16 path in this build. */
int localdiff_int4_has_bf16(void) {
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

/* Vector width in floats of the FMA path of this build. */
int localdiff_int4_vector_width(void) { return VW; }

/* y = x @ dequantize(q, s, z)^T. x: bf16 bits (x_bf16 = 1; needs localdiff_int4_has_bf16) or fp32, [M, 64 * G].
 * Returns 0; -1 when a thread could not be started (the result is still complete: the caller's thread ran that
 * range); -2 for bf16 x without the bf16 path, or no memory (nothing written). y: fp32 [M, ldy], or bf16 bits
 * when y_bf16 (each fp32 sum rounded once, as a cast of the fp32 result would be). */
int localdiff_int4_mm(const void *x, int x_bf16, long ldx, long M, long G, const uint8_t *q, long N,
                      const uint16_t *scale, const uint16_t *zero, void *y, long ldy, int threads, int y_bf16) {
    float *xsum = NULL;
#ifdef HAVE_BF16
    if (x_bf16) {
        xsum = malloc((size_t)(M * G > 0 ? M * G : 1) * sizeof(float));
        if (!xsum) return -2;
        for (long m = 0; m < M; m++)
            for (long g = 0; g < G; g++) {
                const uint16_t *p = (const uint16_t *)x + m * ldx + g * GROUP;
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
                for (int c = 0; c < GROUP; c += 32) {
                    __m512i v = _mm512_loadu_si512((const void *)(p + c));
                    a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
                    b = _mm512_add_ps(b, _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))));
                }
                xsum[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
            }
    }
#else
    if (x_bf16) return -2;
#endif
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 7) / 8 * 8;                        /* ranges start on 8-row boundaries */
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int nj = 0, rc = 0;
    for (long b = 0; b < N; b += per) {
        job_t jb = {x, ldx, M, G, xsum, q, scale, zero, y, ldy, b, b + per < N ? b + per : N, x_bf16, y_bf16};
        jobs[nj++] = jb;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, thread_main, &jobs[i]) == 0;
    if (nj > 0) run_range(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else {
            run_range(&jobs[i]);
            rc = -1;
        }
    }
    free(xsum);
    return rc;
}

/* out[n, k] = bf16((q[n, k] - z[n, g]) * s[n, g]) for rows n0 .. n1 - 1 (fp32 arithmetic, rounded to nearest even:
 * bit-equal to localdiff/quantize/int4.py's dequantize(..., dtype=bfloat16)); out: [n1 - n0, 64 * G] bf16 bits. For
 * int4_matmul's many-row path (dequantize a block of rows, then a bf16 GEMM). Returns 0. */
int localdiff_int4_dequant_bf16(const uint8_t *q, const uint16_t *scale, const uint16_t *zero, long G, long n0,
                                long n1, uint16_t *out) {
    const long K = G * GROUP;
    for (long n = n0; n < n1; n++) {
        uint16_t *o = out + (n - n0) * K;
        for (long g = 0; g < G; g++) {
            const uint8_t *p = q + n * G * GBYTES + g * GBYTES;
            const float sc = bf16_f(scale[n * G + g]), zf = f16_f(zero[n * G + g]);
            uint16_t *og = o + g * GROUP;
            for (int i = 0; i < GBYTES; i++) {
                float lo = ((float)(p[i] & 15) - zf) * sc, hi = ((float)(p[i] >> 4) - zf) * sc;
                uint32_t a, b;
                memcpy(&a, &lo, sizeof a);
                memcpy(&b, &hi, sizeof b);
                og[i] = (uint16_t)((a + 0x7FFFu + ((a >> 16) & 1u)) >> 16);
                og[i + GBYTES] = (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
            }
        }
    }
    return 0;
}

/* Stacked experts: for each expert e, rows off[e] .. off[e + 1] - 1 of x (rows sorted by expert) times expert e's
 * weight (q, scale, zero: [E, N, ...] stacked) into the same rows of y; localdiff_int4_mm per expert, one call from
 * Python for all of them. Returns as localdiff_int4_mm (the first -2, else -1 when any expert returned it). */
int localdiff_int4_mm_grouped(const void *x, int x_bf16, long ldx, const long *off, long E, long G, const uint8_t *q,
                              long N, const uint16_t *scale, const uint16_t *zero, void *y, long ldy, int threads,
                              int y_bf16) {
    const long xel = x_bf16 ? 2 : 4, yel = y_bf16 ? 2 : 4;
    int rc = 0;
    for (long e = 0; e < E; e++) {
        const long m0 = off[e], m = off[e + 1] - off[e];
        if (m <= 0) continue;
        int r = localdiff_int4_mm((const char *)x + m0 * ldx * xel, x_bf16, ldx, m, G, q + e * N * G * GBYTES, N,
                                  scale + e * N * G, zero + e * N * G, (char *)y + m0 * ldy * yel, ldy, threads,
                                  y_bf16);
        if (r == -2) return -2;
        if (r) rc = r;
    }
    return rc;
}
