/* localdiff: int4 weights x int8 activations by AVX512-VNNI (vpdpbusd), for the routed experts' few rows.
 *
 * y[m, n] = sum_g sx[m, g] * s[n, g] * (sum_{k in g} xi[m, k] * q[n, k] - z[n, g] * sum_{k in g} xi[m, k])
 *
 * Weights: localdiff/quantize/int4.py's format unchanged (groups of 64; q uint8 [N, G * 32], byte i of group g =
 * codes of k = 64g + i (low nibble) and 64g + 32 + i (high); scale bf16 bits [N, G]; zero fp16 bits [N, G]).
 * Activations: each row's group of 64 features quantized once per call to int8, symmetric absmax (the scheme of
 * llama.cpp's Q8_0 blocks, here 64 wide to match the weight groups): amax = max |x|, sx = amax / 127,
 * xi = round-half-even(x * (127 / amax)) (fp32 arithmetic; amax = 0 gives sx = 0, xi = 0). This changes the
 * numerics against the bf16 / fp32 kernels of int4.c: the result equals a float64 computation on the dequantized
 * int8 activations (sx * xi) and int4 weights, up to fp32 rounding (tests/quant/test_int4_vnni.py).
 *
 * Inner loop: 4 groups of one weight row at a time. Two 64-byte loads of the row's 128 code bytes and two vpermt2q
 * give 4 vectors of 64 codes 0..15 as unsigned bytes, each with 16 codes of each of the 4 groups (a quarter of the
 * vector per group); one vpdpbusd per vector multiplies them with the matching int8 activations (reordered to the
 * same layout once per call) and sums 4 products per int32 lane, so 4 vpdpbusd compute 256 exact multiply-adds,
 * each lane holding one group's partial sum. One vcvtdq2ps, one vmulps (s * sx, per lane) and one FMA per 4 groups
 * apply the scales: 7 instructions per 256 multiply-adds, against 12 for the vdpbf16ps loop of int4.c (two
 * vdpbf16ps and one FMA per group). The zero-point terms z * sx * sum(xi) are one FMA per 16 groups and row.
 * The codes of a strip of R weight rows are unpacked once into an L1 buffer and reused by every tile of MT
 * activation rows.
 * Threads: N is split into `threads` contiguous ranges, each running every expert (pthreads made per call).
 * Dense weights at a few rows (localdiff_int4_vnni_mm, dense_tile): the same vector layout, the codes decoded in
 * registers straight from the weight (at 1 row nothing would reuse an L1 copy), the next rows prefetched in order.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__) && defined(__F16C__)
#include <immintrin.h>
#define HAVE_VNNI 1
#endif

#define GROUP 64
#define GBYTES 32
#ifndef MT_MAX
#define MT_MAX 6
#endif
#ifndef RS
#define RS 2
#endif
#define MAX_THREADS 256
#define DMT_MAX 4                              /* dense kernel: activation rows per tile */
#define PFT 1
#define TILE_BYTES 4096
#define PFH 3
#define DR 4                                   /* dense kernel: weight rows per tile (at most) */
#define OUT_MAX (MT_MAX * RS > DMT_MAX * DR ? MT_MAX * RS : DMT_MAX * DR)

/* 1 when this build has the VNNI path (the library loads either way; without it every call returns -3). */
int localdiff_int4_vnni_available(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

static inline float bf16_f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

#ifdef HAVE_VNNI
/* Per call: every row quantized and laid out for the inner loop. B = blocks of 4 groups, G16 = G rounded up to 16.
 * xr[m][b][j][64]: vector j of block b (j = 0: k 0..15 of each of the 4 groups, 1: k 32..47, 2: k 16..31, 3: k
 * 48..63; group a of the block in bytes 16a .. 16a + 15); sxv[m][b][16]: lane 4a + t = sx of group 4b + a;
 * xsf[m][G16] = sx * sum(xi) per group (zeros past G). */
typedef struct {
    int8_t *xr;
    float *sxv, *xsf;
    long B, G16;
} acts_t;

/* 16 values of x from element i as fp32 */
static inline __m512 load16(const void *x, int x_bf16, long i) {
    if (x_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}

static int quantize_acts(const void *x, int x_bf16, long ldx, long M, long G, acts_t *a) {
    a->B = (G + 3) / 4;
    a->G16 = (G + 15) / 16 * 16;
    size_t nr = (size_t)(M > 0 ? M : 1);
    a->xr = aligned_alloc(64, nr * a->B * 256);
    a->sxv = aligned_alloc(64, nr * a->B * 64);
    a->xsf = aligned_alloc(64, nr * a->G16 * 4);
    if (!a->xr || !a->sxv || !a->xsf) return -2;
    if (G % 4) memset(a->xr, 0, nr * a->B * 256), memset(a->sxv, 0, nr * a->B * 64);
    memset(a->xsf, 0, nr * a->G16 * 4);
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (long m = 0; m < M; m++)
        for (long g = 0; g < G; g++) {
            __m512 v[4];
            for (int c = 0; c < 4; c++) v[c] = load16(x, x_bf16, m * ldx + g * GROUP + 16 * c);
            const __m512 mx = _mm512_max_ps(_mm512_max_ps(_mm512_and_ps(v[0], absmask), _mm512_and_ps(v[1], absmask)),
                                            _mm512_max_ps(_mm512_and_ps(v[2], absmask), _mm512_and_ps(v[3], absmask)));
            const float amax = _mm512_reduce_max_ps(mx);
            const long b = g / 4, q = g % 4;
            int8_t *dst = a->xr + (m * a->B + b) * 256 + q * 16;
            float sx = 0.0f;
            int sum = 0;
            if (amax > 0.0f) {              /* (a NaN amax: not > 0, the group is zero) */
                const __m512 inv = _mm512_set1_ps(127.0f / amax);
                const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
                __m512i t = _mm512_setzero_si512();
                static const int dstj[4] = {0, 2, 1, 3};       /* k 0..15 -> j 0, 16..31 -> 2, 32..47 -> 1, 48.. -> 3 */
                for (int c = 0; c < 4; c++) {
                    /* vcvtps2dq rounds by MXCSR: to nearest, ties to even (the default mode) */
                    __m512i r = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v[c], inv)), lo), hi);
                    t = _mm512_add_epi32(t, r);
                    _mm_storeu_si128((__m128i *)(dst + 64 * dstj[c]), _mm512_cvtepi32_epi8(r));
                }
                sx = amax / 127.0f;
                sum = _mm512_reduce_add_epi32(t);
            } else
                for (int c = 0; c < 4; c++) memset(dst + 64 * c, 0, 16);
            _mm_storeu_ps(a->sxv + (m * a->B + b) * 16 + q * 4, _mm_set1_ps(sx));
            a->xsf[m * a->G16 + g] = sx * (float)sum;
        }
    return 0;
}

typedef struct {
    const acts_t *a;
    const long *off;
    long E, G, N;
    const uint8_t *q;
    const uint16_t *s, *z;
    void *y;
    long ldy, n_begin, n_end;
    int y_bf16;
    uint8_t *cb;                           /* [RS][B][4][64] unpacked codes of the current strip */
    float *sv, *szv;                       /* [RS][B][16]: s per lane; [RS][G16] s * z per group */
} job_t;

/* Unpack row n of expert e into slot r of the strip buffers. */
static void unpack_row(const job_t *j, long e, long n, int r) {
    const long G = j->G, B = j->a->B, G16 = j->a->G16;
    const uint8_t *q = j->q + (e * j->N + n) * G * GBYTES;
    const uint16_t *s = j->s + (e * j->N + n) * G, *z = j->z + (e * j->N + n) * G;
    const __m512i lo4 = _mm512_set1_epi8(15);
    const __m512i i0 = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), i1 = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    const __m512i rep = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    for (long b = 0; b < B; b++) {
        const long v = G - 4 * b < 4 ? G - 4 * b : 4;          /* groups in this block */
        const long nb = v * GBYTES;
        const __mmask64 m0 = nb >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
        const __mmask64 m1 = nb >= 128 ? ~(__mmask64)0 : nb <= 64 ? 0 : (((__mmask64)1 << (nb - 64)) - 1);
        const __m512i A = _mm512_maskz_loadu_epi8(m0, q + b * 128), Bv = _mm512_maskz_loadu_epi8(m1, q + b * 128 + 64);
        const __m512i p0 = _mm512_permutex2var_epi64(A, i0, Bv), p1 = _mm512_permutex2var_epi64(A, i1, Bv);
        uint8_t *dst = j->cb + ((long)r * B + b) * 256;
        _mm512_store_si512((void *)dst, _mm512_and_si512(p0, lo4));
        _mm512_store_si512((void *)(dst + 64), _mm512_and_si512(_mm512_srli_epi16(p0, 4), lo4));
        _mm512_store_si512((void *)(dst + 128), _mm512_and_si512(p1, lo4));
        _mm512_store_si512((void *)(dst + 192), _mm512_and_si512(_mm512_srli_epi16(p1, 4), lo4));
        const __mmask8 mv = (__mmask8)((1u << v) - 1);
        __m128i sb = _mm_maskz_loadu_epi16(mv, s + 4 * b);
        __m512 s4 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_castsi128_si512(_mm_cvtepu16_epi32(sb)), 16));
        _mm512_store_ps(j->sv + ((long)r * B + b) * 16, _mm512_permutexvar_ps(rep, s4));
    }
    for (long g = 0; g < G16; g += 16) {
        const __mmask16 mk = G - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - g)) - 1);
        __m512 sv = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, s + g)),
                                                          16));
        __m512 zf = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, z + g));
        _mm512_store_ps(j->szv + (long)r * G16 + g, _mm512_maskz_mul_ps(mk, sv, zf));
    }
}

/* The horizontal sums of 4 vectors: {sum(a), sum(b), sum(c), sum(d)}. */
static inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));   /* a0+a2 b0+b2 a1+a3 b1+b3 */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 t = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* Horizontal sums of the tile's MT * R accumulators (acc[m * lda + r]), 4 at a time, rounded as a group, into
 * rows m0 .. m0 + MT - 1, columns n0 .. n0 + R - 1 of y. */
static inline __attribute__((always_inline)) void store_acc(const job_t *j, const __m512 *acc, const int lda,
                                                            long m0, long n0, const int MT, const int R) {
    float out[OUT_MAX + 3];
#pragma GCC unroll 8
    for (int i = 0; i < MT * R; i += 4) {
        __m512 v[4];
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) v[t] = i + t < MT * R ? acc[(i + t) / R * lda + (i + t) % R] : _mm512_setzero_ps();
        __m128 h = hsum4(v[0], v[1], v[2], v[3]);
        if (j->y_bf16) {           /* to nearest even, as torch's cast; NaN -> 0x7FC0 */
            __m128i u = _mm_castps_si128(h);
            __m128i rnd = _mm_add_epi32(_mm_set1_epi32(0x7FFF), _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1)));
            __m128i nan = _mm_cmpgt_epi32(_mm_and_si128(u, _mm_set1_epi32(0x7FFFFFFF)), _mm_set1_epi32(0x7F800000));
            u = _mm_blendv_epi8(_mm_add_epi32(u, rnd), _mm_set1_epi32(0x7FC00000), nan);
            h = _mm_castsi128_ps(_mm_srli_epi32(u, 16));
        }
        _mm_storeu_ps(out + i, h);
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++) {
        if (j->y_bf16) {
            uint16_t *yb = (uint16_t *)j->y + (m0 + m) * j->ldy + n0;
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                uint32_t u;
                memcpy(&u, out + m * R + r, 4);
                yb[r] = (uint16_t)u;
            }
        } else
            memcpy((float *)j->y + (m0 + m) * j->ldy + n0, out + m * R, R * sizeof(float));
    }
}

/* MT activation rows (from m0) times the R unpacked weight rows of the strip (output rows n0 ..). */
static inline __attribute__((always_inline)) void tile(const job_t *j, long m0, long n0, const int MT, const int R) {
    const acts_t *a = j->a;
    const long B = a->B;
    __m512 acc[MT_MAX][RS];
#pragma GCC unroll 6
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (long b = 0; b < B; b++) {
        __m512i cv[RS][4];
        __m512 sv[RS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const uint8_t *c = j->cb + ((long)r * B + b) * 256;
            for (int t = 0; t < 4; t++) cv[r][t] = _mm512_load_si512((const void *)(c + 64 * t));
            sv[r] = _mm512_load_ps(j->sv + ((long)r * B + b) * 16);
        }
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const int8_t *xr = a->xr + ((m0 + m) * B + b) * 256;
            const __m512i x0 = _mm512_load_si512((const void *)xr), x1 = _mm512_load_si512((const void *)(xr + 64));
            const __m512i x2 = _mm512_load_si512((const void *)(xr + 128));
            const __m512i x3 = _mm512_load_si512((const void *)(xr + 192));
            const __m512 sx = _mm512_load_ps(a->sxv + ((m0 + m) * B + b) * 16);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cv[r][0], x0);
                d = _mm512_dpbusd_epi32(d, cv[r][1], x1);
                d = _mm512_dpbusd_epi32(d, cv[r][2], x2);
                d = _mm512_dpbusd_epi32(d, cv[r][3], x3);
                acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv[r], sx), acc[m][r]);
            }
        }
    }
    /* the zero-point terms (lanes: groups; only the lanes' total matters) */
    for (long g = 0; g < a->G16; g += 16)
#pragma GCC unroll 6
        for (int m = 0; m < MT; m++) {
            const __m512 xs = _mm512_load_ps(a->xsf + (m0 + m) * a->G16 + g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++)
                acc[m][r] = _mm512_fnmadd_ps(_mm512_load_ps(j->szv + (long)r * a->G16 + g), xs, acc[m][r]);
        }
    /* horizontal sums, 4 accumulators at a time (the tile's MT * R in row-major order), rounded as a group */
    store_acc(j, &acc[0][0], RS, m0, n0, MT, R);
}

/* tile() with MT and R as constants */
static void run_tile(const job_t *j, long m0, long n0, int mt, int r) {
#define T(MT, R) case MT * 16 + R: if (MT <= MT_MAX && R <= RS) tile(j, m0, n0, MT, R); break;
#define TR(MT) T(MT, 1) T(MT, 2) T(MT, 3) T(MT, 4)
    switch (mt * 16 + r) { TR(1) TR(2) TR(3) TR(4) TR(5) TR(6) TR(7) TR(8) }
#undef TR
#undef T
}

static void run_range(job_t *j) {
    for (long e = 0; e < j->E; e++) {
        const long r0 = j->off[e], r1 = j->off[e + 1];
        if (r1 <= r0) continue;
        for (long n = j->n_begin; n < j->n_end; n += RS) {
            const int R = j->n_end - n >= RS ? RS : (int)(j->n_end - n);
            for (int r = 0; r < R; r++) unpack_row(j, e, n + r, r);
            {   /* the next strip's codes (the next expert's first rows after the last strip) */
                const uint8_t *nx = j->q + (e * j->N + n + RS) * j->G * GBYTES;
                for (long i = 0; i < RS * j->G * GBYTES; i += 64) __builtin_prefetch(nx + i, 0, 3);
            }
            /* rows of this expert in tiles of at most MT_MAX, sizes balanced (10 rows: 5 + 5, not 6 + 4) */
            const long rows = r1 - r0, nt = (rows + MT_MAX - 1) / MT_MAX;
            for (long t = 0, m = r0; t < nt; t++) {
                const long mt = (rows - (m - r0) + (nt - t) - 1) / (nt - t);
                run_tile(j, m, n, (int)mt, R);
                m += mt;
            }
        }
    }
}

static void *thread_main(void *arg) {
    run_range((job_t *)arg);
    return NULL;
}

/* Dense (one weight, a few activation rows): MT activation rows times R weight rows read straight from the packed
 * weight (no L1 staging: at 1 row nothing would reuse it). Per block of 4 groups and weight row: two 64-byte loads,
 * two vpermt2q and 6 mask / shift ops give the 4 code vectors; one vpermps spreads the 4 groups' scales over their
 * lanes (the scales of 16 groups are converted once per 16 groups, with the zero-point terms). The next R rows are
 * prefetched while these run (the hardware prefetchers stop at 4 KiB pages). Every output is summed in the same
 * order whatever MT, R and the thread split: zero-point terms of 16 groups, then those 4 blocks. */
static inline __attribute__((always_inline)) void dense_tile(const job_t *j, long m0, long n0, const int MT,
                                                             const int R) {
    const acts_t *a = j->a;
    const long G = j->G, B = a->B, G16 = a->G16, ldq = G * GBYTES;
    const uint8_t *q = j->q + n0 * ldq;
    const uint16_t *s = j->s + n0 * G, *z = j->z + n0 * G;
    const __m512i lo4 = _mm512_set1_epi8(15);
    const __m512i i0 = _mm512_setr_epi64(0, 1, 4, 5, 8, 9, 12, 13), i1 = _mm512_setr_epi64(2, 3, 6, 7, 10, 11, 14, 15);
    const __m512i rep[4] = {_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                            _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
                            _mm512_setr_epi32(8, 8, 8, 8, 9, 9, 9, 9, 10, 10, 10, 10, 11, 11, 11, 11),
                            _mm512_setr_epi32(12, 12, 12, 12, 13, 13, 13, 13, 14, 14, 14, 14, 15, 15, 15, 15)};
    const int pf = m0 == 0;
    __m512 acc[DMT_MAX][DR];
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    for (long c = 0; c < G16; c += 16) {
        const __mmask16 mk = G - c >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (G - c)) - 1);
        __m512 sc[DR];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            sc[r] = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, s + r * G + c)), 16));
            const __m512 sz = _mm512_mul_ps(sc[r], _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mk, z + r * G + c)));
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++)
                acc[m][r] = _mm512_fnmadd_ps(sz, _mm512_load_ps(a->xsf + (m0 + m) * G16 + c), acc[m][r]);
        }
        const long b1 = c / 4 + 4 < B ? c / 4 + 4 : B;
#pragma GCC unroll 4
        for (long b = c / 4; b < b1; b++) {
            __m512i cv[DR][4];
            __m512 sv[DR];
            const long nb = (G - 4 * b < 4 ? G - 4 * b : 4) * GBYTES;
            if (pf) {                      /* the next tile's bytes, in order, spread over this tile's blocks */
                const uint8_t *nx = q + PFT * R * ldq + b * R * 128;
#pragma GCC unroll 8
                for (int i = 0; i < R * 128; i += 64) __builtin_prefetch(nx + i, 0, PFH);
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const uint8_t *qb = q + r * ldq + b * 128;
                __m512i A, Bv;
                if (nb == 128)
                    A = _mm512_loadu_si512((const void *)qb), Bv = _mm512_loadu_si512((const void *)(qb + 64));
                else {
                    const __mmask64 k0 = nb >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << nb) - 1);
                    const __mmask64 k1 = nb <= 64 ? 0 : (((__mmask64)1 << (nb - 64)) - 1);
                    A = _mm512_maskz_loadu_epi8(k0, qb), Bv = _mm512_maskz_loadu_epi8(k1, qb + 64);
                }
                const __m512i p0 = _mm512_permutex2var_epi64(A, i0, Bv), p1 = _mm512_permutex2var_epi64(A, i1, Bv);
                cv[r][0] = _mm512_and_si512(p0, lo4);
                cv[r][1] = _mm512_and_si512(_mm512_srli_epi16(p0, 4), lo4);
                cv[r][2] = _mm512_and_si512(p1, lo4);
                cv[r][3] = _mm512_and_si512(_mm512_srli_epi16(p1, 4), lo4);
                sv[r] = _mm512_permutexvar_ps(rep[b - c / 4], sc[r]);
            }
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) {
                const int8_t *xr = a->xr + ((m0 + m) * B + b) * 256;
                const __m512i x0 = _mm512_load_si512((const void *)xr), x1 = _mm512_load_si512((const void *)(xr + 64));
                const __m512i x2 = _mm512_load_si512((const void *)(xr + 128));
                const __m512i x3 = _mm512_load_si512((const void *)(xr + 192));
                const __m512 sx = _mm512_load_ps(a->sxv + ((m0 + m) * B + b) * 16);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), cv[r][0], x0);
                    d = _mm512_dpbusd_epi32(d, cv[r][1], x1);
                    d = _mm512_dpbusd_epi32(d, cv[r][2], x2);
                    d = _mm512_dpbusd_epi32(d, cv[r][3], x3);
                    acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sv[r], sx), acc[m][r]);
                }
            }
        }
    }
    store_acc(j, &acc[0][0], DR, m0, n0, MT, R);
}

/* dense_tile() with MT and R as constants; R for MT rows: DENSE_R[MT] (fewer at a range's end) */
static const int DENSE_R[DMT_MAX + 1] = {0, DR, DR, 2, 2};

static void dense_run_tile(const job_t *j, long m0, long n0, int mt, int r) {
#define T(MT, R) case MT * 16 + R: dense_tile(j, m0, n0, MT, R); break;
#define TR(MT) T(MT, 1) T(MT, 2) T(MT, 4)
    switch (mt * 16 + r) { TR(1) TR(2) TR(3) TR(4) }
#undef TR
#undef T
}

static void dense_range(job_t *j) {
    const long M = j->off[1];
    const int mt0 = M < DMT_MAX ? (int)M : DMT_MAX;
    int R = DENSE_R[mt0];
    while (R > 1 && R * j->G * GBYTES > TILE_BYTES) R /= 2;   /* tiles of at most 4 KiB (one row at least) */
    for (long n = j->n_begin; n < j->n_end; n += R) {
        while (n + R > j->n_end) R /= 2;
        /* rows in tiles of at most DMT_MAX, sizes balanced (6 rows: 3 + 3) */
        const long nt = (M + DMT_MAX - 1) / DMT_MAX;
        for (long t = 0, m = 0; t < nt; t++) {
            const long mt = (M - m + (nt - t) - 1) / (nt - t);
            const int rr = R < DENSE_R[mt] ? R : DENSE_R[mt];
            for (int o = 0; o < R; o += rr) dense_run_tile(j, m, n + o, (int)mt, rr);
            m += mt;
        }
    }
}

static void *dense_main(void *arg) {
    dense_range((job_t *)arg);
    return NULL;
}
#endif

/* The activation quantization alone, as the kernel does it (tests): xi int8 [M, 64 G], sx fp32 [M, G]. x: [M, ldx]
 * bf16 bits (x_bf16) or fp32, 64 G valid columns. Returns 0, -2 out of memory, -3 no VNNI path in this build. */
int localdiff_int4_vnni_quantize(const void *x, int x_bf16, long ldx, long M, long G, int8_t *xi, float *sx) {
#ifndef HAVE_VNNI
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)G, (void)xi, (void)sx;
    return -3;
#else
    static const int kof[4] = {0, 32, 16, 48};
    acts_t a = {0};
    int rc = quantize_acts(x, x_bf16, ldx, M, G, &a);
    for (long m = 0; rc == 0 && m < M; m++)
        for (long g = 0; g < G; g++) {
            for (int j = 0; j < 4; j++)
                memcpy(xi + m * G * GROUP + g * GROUP + kof[j], a.xr + (m * a.B + g / 4) * 256 + j * 64 + g % 4 * 16,
                       16);
            sx[m * G + g] = a.sxv[(m * a.B + g / 4) * 16 + g % 4 * 4];
        }
    free(a.xr), free(a.sxv), free(a.xsf);
    return rc;
#endif
}

/* Stacked experts (E = 1: one plain weight): rows off[e] .. off[e + 1] - 1 of x (rows sorted by expert) times expert
 * e's int4 weight (q [E, N, G * 32], scale / zero [E, N, G]) into the same rows of y (fp32, or bf16 bits when
 * y_bf16: each fp32 result rounded once, to nearest even). x: bf16 bits (x_bf16) or fp32 [off[E], ldx], 64 G valid
 * columns (zero past the true K). Returns 0; -1 when a thread could not be started (the result is still complete);
 * -2 out of memory; -3 no VNNI path in this build; -4 off[0] != 0 (nothing written in these three). */
int localdiff_int4_vnni_mm_grouped(const void *x, int x_bf16, long ldx, const long *off, long E, long G,
                                   const uint8_t *q, long N, const uint16_t *scale, const uint16_t *zero, void *y,
                                   long ldy, int threads, int y_bf16) {
#ifndef HAVE_VNNI
    (void)x, (void)x_bf16, (void)ldx, (void)off, (void)E, (void)G, (void)q, (void)N, (void)scale, (void)zero;
    (void)y, (void)ldy, (void)threads, (void)y_bf16;
    return -3;
#else
    if (off[0] != 0) return -4;
    acts_t a = {0};
    int rc = quantize_acts(x, x_bf16, ldx, off[E], G, &a);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 7) / 8 * 8;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0;
    const size_t cbn = (size_t)RS * a.B * 256, svn = (size_t)RS * a.B * 16, szn = (size_t)RS * a.G16;
    for (long b = 0; rc == 0 && b < N; b += per) {
        job_t jb = {&a, off, E, G, N, q, scale, zero, y, ldy, b, b + per < N ? b + per : N, y_bf16, NULL, NULL, NULL};
        jb.cb = aligned_alloc(64, (cbn + 63) / 64 * 64);
        jb.sv = aligned_alloc(64, (svn * 4 + 63) / 64 * 64);
        jb.szv = aligned_alloc(64, (szn * 4 + 63) / 64 * 64);
        jobs[nj++] = jb;
        if (!jb.cb || !jb.sv || !jb.szv) rc = -2;
    }
    if (rc == 0) {
        for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, thread_main, &jobs[i]) == 0;
        if (nj > 0) run_range(&jobs[0]);
        for (int i = 1; i < nj; i++) {
            if (started[i]) pthread_join(tid[i], NULL);
            else {
                run_range(&jobs[i]);
                rc = -1;
            }
        }
    }
    for (int i = 0; i < nj; i++) free(jobs[i].cb), free(jobs[i].sv), free(jobs[i].szv);
    free(a.xr), free(a.sxv), free(a.xsf);
    return rc;
#endif
}

/* One int4 weight (q [N, G * 32], scale / zero [N, G]) times M rows of x (bf16 bits when x_bf16, else fp32; [M, ldx],
 * 64 G valid columns, zero past the true K) with int8-quantized activations, for few rows (dense_tile: codes decoded
 * in registers, no staging); y as in localdiff_int4_vnni_mm_grouped. Each output is summed in an order independent
 * of M and threads. Returns 0; -1 a thread could not be started (the result is still complete); -2 out of memory;
 * -3 no VNNI path in this build. */
int localdiff_int4_vnni_mm(const void *x, int x_bf16, long ldx, long M, long G, const uint8_t *q, long N,
                           const uint16_t *scale, const uint16_t *zero, void *y, long ldy, int threads, int y_bf16) {
#ifndef HAVE_VNNI
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)G, (void)q, (void)N, (void)scale, (void)zero;
    (void)y, (void)ldy, (void)threads, (void)y_bf16;
    return -3;
#else
    acts_t a = {0};
    int rc = quantize_acts(x, x_bf16, ldx, M, G, &a);
    const long off[2] = {0, M};
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 7) / 8 * 8;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0;
    for (long b = 0; rc == 0 && M > 0 && b < N; b += per) {
        job_t jb = {&a, off, 1, G, N, q, scale, zero, y, ldy, b, b + per < N ? b + per : N, y_bf16, NULL, NULL, NULL};
        jobs[nj++] = jb;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, dense_main, &jobs[i]) == 0;
    if (nj > 0) dense_range(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else {
            dense_range(&jobs[i]);
            rc = -1;
        }
    }
    free(a.xr), free(a.sxv), free(a.xsf);
    return rc;
#endif
}
