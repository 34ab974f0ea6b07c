/* localdiff: int8 weights x int8 activations by AVX512-VNNI (vpdpbusd), for the block steps of several requests.
 *
 * y[m, n] = scale[n] * sum_g sx[m, g] * sum_{k in g} xi[m, k] * q[n, k]
 *
 * Weights: localdiff/quantize/int8.py's format unchanged (q int8 [N, K] row-major, |q| <= 127; scale [N] bf16 bits
 * or fp32). Activations: each row quantized once per call to int8 in groups of 64 features, symmetric absmax (as
 * int4_vnni.c and llama.cpp's Q8_0): amax = max |x| over the group, sx = amax / 127, xi = round-half-even(x * (127 /
 * amax)) in fp32 (amax = 0 gives sx = 0, xi = 0). The groups follow the weight's natural byte order so that no
 * weight byte is moved in registers: a row is cut into blocks of 1024 features (the last one zero-padded) and
 * feature k belongs to group 16 * (k / 1024) + (k % 64) / 4, i.e. a group is the 4-feature slot s of each of the
 * block's 16 chunks of 64 features (4 * 16 = 64 features). This changes the numerics against the exact kernels of
 * int8.c: the result equals a float64 computation on the dequantized int8 activations (sx * xi) and int8 weights
 * up to fp32 rounding (tests/quant/test_int8_vnni.py).
 *
 * Signed x signed with vpdpbusd (u8 x s8): the weights are fed as unsigned bytes q ^ 0x80 = q + 128 (one xor per
 * 64 weights, shared by the tile's rows), the activations as s8, so sum (q + 128) * xi = sum q * xi + 128 * sum xi;
 * the int32 accumulator of each 64-byte vector's lane s (4 products, group s of the block) starts at -128 * sum xi
 * of that group (computed at quantize time), so the integer group sums are exact. Per block of 1024 features and
 * (activation row, weight row): 16 vpdpbusd (1024 exact multiply-adds), one vcvtdq2ps and one FMA with the 16 groups'
 * sx; after the last block one horizontal sum (fixed order) and one product with scale[n].
 * Every output is summed in that order whatever the number of rows, the tiles and the threads: a row's result is
 * bit-identical alone and in a batch. Threads: N is split into `threads` contiguous ranges (pthreads per call).
 * Measured on a Zen 4 core (docs/BENCHMARKS.md): 1-4 rows read the weight at ~20-26 GB/s (the next strip
 * prefetched); 16 rows run at vpdpbusd's issue rate (~1.5 G/s zmm in a register-only loop, twice vdpbf16ps's MACs),
 * so a 16-row call costs ~2.6x a 4-row call: what remains needs more cores or AMX-INT8, not this loop.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VNNI 1
#endif

#define BLK 1024                               /* features per block: 16 vectors of 64 */
#define VPB 16
#define MT_MAX 4                               /* activation rows per tile */
#define RT_MAX 4                               /* weight rows per tile */
#ifndef PF_L1_BYTES
#define PF_L1_BYTES 24576                      /* prefetch into L1 while strip + next strip + rows fit in this */
#endif
#define MAX_THREADS 256

/* 1 when this build has the VNNI path (the library loads either way; without it every call returns -3). */
int localdiff_int8_vnni_available(void) {
#ifdef HAVE_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef HAVE_VNNI
/* Per call: xr [M][B * 1024] int8 activations (zeros past K), sxv [M][B][16] fp32 (lane s: sx of group s of block
 * b), cv [M][B][16] int32 (lane s: -128 * sum xi of that group). */
typedef struct {
    int8_t *xr;
    float *sxv;
    int32_t *cv;
    long B, K, ldxr;
} acts_t;

static inline __m512 load16(const void *x, int x_bf16, long i, __mmask16 mk) {
    if (x_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)x + i)), 16));
    return _mm512_maskz_loadu_ps(mk, (const float *)x + i);
}

/* within each quad of 4 lanes, every lane set to the quad's max (fp32) / sum (int32) */
static inline __m512 quad_max(__m512 v) {
    v = _mm512_max_ps(v, _mm512_permute_ps(v, 0xB1));
    return _mm512_max_ps(v, _mm512_permute_ps(v, 0x4E));
}

static inline __m512i quad_sum(__m512i v) {
    v = _mm512_add_epi32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0xB1));
    return _mm512_add_epi32(v, _mm512_shuffle_epi32(v, (_MM_PERM_ENUM)0x4E));
}

static int quantize_acts(const void *x, int x_bf16, long ldx, long M, long K, acts_t *a) {
    a->B = (K + BLK - 1) / BLK;
    a->K = K;
    a->ldxr = a->B * BLK;
    const size_t nr = (size_t)(M > 0 ? M : 1);
    a->xr = aligned_alloc(64, nr * a->ldxr);
    a->sxv = aligned_alloc(64, nr * a->B * 64);
    a->cv = aligned_alloc(64, nr * a->B * 64);
    if (!a->xr || !a->sxv || !a->cv) return -2;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    for (long m = 0; m < M; m++)
        for (long b = 0; b < a->B; b++) {
            /* v[i]: features 1024 b + 16 i .. + 15; group 4 c + p = lanes 4p .. 4p + 3 of v[4 j + c], j = 0..15 */
            __m512 v[64];
            for (int i = 0; i < 64; i++) {
                const long k = b * BLK + 16 * i;
                const __mmask16 mk = k >= K ? 0 : K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
                v[i] = load16(x, x_bf16, m * ldx + k, mk);
            }
            float amax[4][16];
            int32_t isum[4][16];
            for (int c = 0; c < 4; c++) {
                __m512 mx = _mm512_setzero_ps();
                for (int j = 0; j < VPB; j++) mx = _mm512_max_ps(mx, _mm512_and_ps(v[4 * j + c], absmask));
                mx = quad_max(mx);                      /* (a NaN: not > 0 below, the group is zero) */
                const __mmask16 pos = _mm512_cmp_ps_mask(mx, _mm512_setzero_ps(), _CMP_GT_OQ);
                const __m512 inv = _mm512_maskz_div_ps(pos, _mm512_set1_ps(127.0f), mx);
                __m512i t = _mm512_setzero_si512();
                for (int j = 0; j < VPB; j++) {
                    /* vcvtps2dq rounds by MXCSR: to nearest, ties to even (the default mode) */
                    __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[4 * j + c], inv));
                    r = _mm512_maskz_mov_epi32(pos, _mm512_min_epi32(_mm512_max_epi32(r, lo), hi));
                    t = _mm512_add_epi32(t, r);
                    _mm_store_si128((__m128i *)(a->xr + m * a->ldxr + b * BLK + 64 * j + 16 * c), _mm512_cvtepi32_epi8(r));
                }
                _mm512_storeu_ps(amax[c], _mm512_maskz_mov_ps(pos, mx));
                _mm512_storeu_si512((void *)isum[c], quad_sum(t));
            }
            float *sx = a->sxv + (m * a->B + b) * 16;
            int32_t *cv = a->cv + (m * a->B + b) * 16;
            for (int s = 0; s < 16; s++) {
                const int c = s / 4, p = s % 4;
                sx[s] = amax[c][4 * p] / 127.0f;
                cv[s] = -128 * isum[c][4 * p];
            }
        }
    return 0;
}

typedef struct {
    const acts_t *a;
    long M;
    const int8_t *q;
    long N;
    const void *s;
    int sbf16, ybf16;
    void *y;
    long ldy, n_begin, n_end;
} job_t;

static inline float get_scale(const void *s, int bf16, long n) {
    if (!bf16) return ((const float *)s)[n];
    uint32_t bits = (uint32_t)((const uint16_t *)s)[n] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t to_bf16(float f) {    /* to nearest even, as torch's cast; NaN -> 0x7FC0 */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* MT activation rows (from m0) times RT weight rows (from n0). The first row tile of a strip (pf != 0) prefetches
 * the next strip's bytes in order, spread over its vectors (the hardware prefetchers stop at 4 KiB pages): into L1
 * (pf = 1) when this strip, the next and the activation rows fit in PF_L1_BYTES, else into L2 (pf = 2; prefetching
 * 2 x 24 KiB strips of K = 6144 into L1 evicted them before use: 4 rows 1.06 -> 0.60 ms, [2048 x 6144], one core). */
static inline __attribute__((always_inline)) void tile(const job_t *j, long m0, long n0, const int MT, const int RT,
                                                      int pf) {
    const acts_t *a = j->a;
    const long K = a->K, B = a->B, ldx = a->ldxr;
    const int8_t *q = j->q + n0 * K;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512 acc[MT_MAX][RT_MAX];
#pragma GCC unroll 4
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 4
        for (int r = 0; r < RT; r++) acc[m][r] = _mm512_setzero_ps();
    for (long b = 0; b < B; b++) {
        const long kb = b * BLK, nv = K - kb >= BLK ? VPB : (K - kb + 63) / 64;
        __m512i d[MT_MAX][RT_MAX];
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            const __m512i c = _mm512_load_si512((const void *)(a->cv + ((m0 + m) * B + b) * 16));
#pragma GCC unroll 4
            for (int r = 0; r < RT; r++) d[m][r] = c;
        }
        for (long v = 0; v < nv; v++) {
            const long k = kb + 64 * v;
            __m512i w[RT_MAX];
            if (pf) {
                const int8_t *nx = q + (long)RT * K + (b * VPB + v) * RT * 64;
                if (pf == 1)
#pragma GCC unroll 4
                    for (int r = 0; r < RT; r++) __builtin_prefetch(nx + 64 * r, 0, 3);
                else
#pragma GCC unroll 4
                    for (int r = 0; r < RT; r++) __builtin_prefetch(nx + 64 * r, 0, 1);
            }
            if (K - k >= 64) {
#pragma GCC unroll 4
                for (int r = 0; r < RT; r++)
                    w[r] = _mm512_xor_si512(_mm512_loadu_si512((const void *)(q + r * K + k)), flip);
            } else {                               /* the K % 64 tail: zero weights (their activations are 0) */
                const __mmask64 mk = ((__mmask64)1 << (K - k)) - 1;
#pragma GCC unroll 4
                for (int r = 0; r < RT; r++) w[r] = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mk, q + r * K + k), flip);
            }
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++) {
                __m512i xv = _mm512_load_si512((const void *)(a->xr + (m0 + m) * ldx + k));
                __asm__("" : "+v"(xv));            /* one load per row, not one per weight row (gcc folds it) */
#pragma GCC unroll 4
                for (int r = 0; r < RT; r++) d[m][r] = _mm512_dpbusd_epi32(d[m][r], w[r], xv);
            }
        }
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            const __m512 sx = _mm512_load_ps(a->sxv + ((m0 + m) * B + b) * 16);
#pragma GCC unroll 4
            for (int r = 0; r < RT; r++) acc[m][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d[m][r]), sx, acc[m][r]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RT; r++) {
        const float sc = get_scale(j->s, j->sbf16, n0 + r);
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++) {
            const float t = _mm512_reduce_add_ps(acc[m][r]) * sc;
            if (j->ybf16) ((uint16_t *)j->y)[(m0 + m) * j->ldy + n0 + r] = to_bf16(t);
            else ((float *)j->y)[(m0 + m) * j->ldy + n0 + r] = t;
        }
    }
}

/* tile() with MT and RT as constants */
static void run_tile(const job_t *j, long m0, long n0, int mt, int rt, int pf) {
#define T(MT, RT) case MT * 8 + RT: tile(j, m0, n0, MT, RT, pf); break;
#define TR(MT) T(MT, 1) T(MT, 2) T(MT, 3) T(MT, 4)
    switch (mt * 8 + rt) { TR(1) TR(2) TR(3) TR(4) }
#undef TR
#undef T
}

/* weight rows per tile for MT activation rows (the MT * RT int32 accumulators, RT weights and one row in registers;
 * the fp32 accumulators, touched once per block, may live on the stack): 4 x 4 measured faster than 4 x 3 */
static const int RT_FOR[MT_MAX + 1] = {0, 4, 4, 4, 4};

static void run_range(const job_t *j) {
    const long M = j->M;
    /* rows in tiles of at most MT_MAX, sizes balanced (6 rows: 3 + 3) */
    const long nt = (M + MT_MAX - 1) / MT_MAX, mt0 = (M + nt - 1) / nt;
    int R = RT_FOR[mt0];
    const int pf = 2 * R * j->a->K + M * j->a->K <= PF_L1_BYTES ? 1 : 2;
    for (long n = j->n_begin; n < j->n_end; n += R) {
        if (n + R > j->n_end) R = (int)(j->n_end - n);
        for (long t = 0, m = 0; t < nt; t++) {
            const long mt = (M - m + (nt - t) - 1) / (nt - t);
            run_tile(j, m, n, (int)mt, R, t == 0 ? pf : 0);
            m += mt;
        }
    }
}

static void *thread_main(void *arg) {
    run_range((const job_t *)arg);
    return NULL;
}
#endif

/* The activation quantization alone, as the kernel does it (tests): x [M, ldx] bf16 bits (x_bf16) or fp32 with K
 * valid columns -> xi int8 [M, B * 1024] (B = ceil(K / 1024), zeros past K), sx fp32 [M, 16 B] (sx of group g).
 * Returns 0, -2 out of memory, -3 no VNNI path in this build. */
int localdiff_int8_vnni_quantize(const void *x, int x_bf16, long ldx, long M, long K, int8_t *xi, float *sx) {
#ifndef HAVE_VNNI
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)xi, (void)sx;
    return -3;
#else
    acts_t a = {0};
    int rc = quantize_acts(x, x_bf16, ldx, M, K, &a);
    if (rc == 0) {
        for (long m = 0; m < M; m++) memcpy(xi + m * a.B * BLK, a.xr + m * a.ldxr, (size_t)a.B * BLK);
        memcpy(sx, a.sxv, (size_t)M * a.B * 16 * sizeof(float));
    }
    free(a.xr), free(a.sxv), free(a.cv);
    return rc;
#endif
}

/* y = scale * (quantized x) @ q^T (see above): x [M, ldx] bf16 bits (x_bf16) or fp32, K valid columns; q int8
 * [N, K]; scale [N] bf16 bits (scale_bf16) or fp32; y [M, ldy] fp32, or bf16 bits when y_bf16 (each fp32 result
 * rounded once, to nearest even). Returns 0; -1 a thread could not be started (the result is still complete);
 * -2 out of memory; -3 no VNNI path in this build (nothing written in these two). */
int localdiff_int8_vnni_mm(const void *x, int x_bf16, long ldx, long M, long K, const int8_t *q, long N,
                           const void *scale, int scale_bf16, void *y, int y_bf16, long ldy, int threads) {
#ifndef HAVE_VNNI
    (void)x, (void)x_bf16, (void)ldx, (void)M, (void)K, (void)q, (void)N, (void)scale, (void)scale_bf16;
    (void)y, (void)y_bf16, (void)ldy, (void)threads;
    return -3;
#else
    if (M < 1 || N < 1) return 0;
    acts_t a = {0};
    int rc = quantize_acts(x, x_bf16, ldx, M, K, &a);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 7) / 8 * 8;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0;
    for (long b = 0; rc == 0 && b < N; b += per) {
        job_t jb = {&a, M, q, N, scale, scale_bf16, y_bf16, y, ldy, b, b + per < N ? b + per : N};
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
    free(a.xr), free(a.sxv), free(a.cv);
    return rc;
#endif
}
