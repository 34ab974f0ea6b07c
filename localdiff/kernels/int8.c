/* localdiff: small-M weight-only int8 matmul for CPUs, y[m, n] = scale[n] * sum_k x[m, k] * q[n, k].
 *
 * Two paths, one file (Python side: localdiff/kernels/int8.py):
 * - localdiff_int8_mm_amx: AMX-INT8 tiles (Sapphire Rapids and later, when -march=native enables AMX and Linux
 *   grants the tile state): the weights are used as stored, x as exact-integer fixed-point digits (see below).
 *   On this project's AMX CPU it reads a 1.84 GB int8 model (with its LM head) at ~10-11 GB/s for 1..4 rows (one core).
 * - localdiff_int8_mm: fp32 FMAs everywhere else. x: fp32 [M, K] (row stride ldx), q: int8 [N, K] (row-major),
 *   scale: [N] fp32 or bf16 (raw uint16 bits), y: fp32 [M, N] (row stride ldy). The weight is streamed once (R
 *   output rows at a time; every row of x is applied while they are in L1), each int8 element converted to fp32
 *   once and multiplied with all M rows by fused multiply-adds into M x R vector accumulators. No activation
 *   quantization: dequantize(q, scale) @ x^T in fp32 up to the summation order (VW partial sums per output, then
 *   the K % VW tail, then one multiplication by the scale). It is instruction-bound, not memory-bound, on the
 *   AMX CPU (~5 GB/s of weights at 4 rows), which is why the AMX path exists.
 *
 * Plain C with GCC/Clang vector extensions (intrinsics only for the int8 -> fp32 load on x86 and the AMX path):
 * -march=native gives zmm FMAs on AVX-512, ymm on AVX2; other targets build too (the compiler splits or
 * scalarises the vectors). Threads: N is split into `threads` contiguous ranges (pthreads created per call; the
 * caller's thread runs the first range).
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
#else
#define VW 8
#define ACC_BUDGET 8
#endif
#define MT_MAX 8

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int8_t vb __attribute__((vector_size(VW)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

/* VW int8 weights -> VW floats: one sign-extending load + one convert on x86 (gcc 12 scalarises the generic
 * __builtin_convertvector of int8 vectors, so the two x86 widths name their instructions). */
static inline vf load_q(const int8_t *p) {
#if defined(__AVX512F__)
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vb b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(__builtin_convertvector(b, vi), vf);
#endif
}

static inline vf load_x(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float get_scale(const void *s, int bf16, long n) {
    if (!bf16) return ((const float *)s)[n];
    uint32_t bits = (uint32_t)((const uint16_t *)s)[n] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One tile: MT rows of x times R rows of q (MT, R compile-time after inlining). */
static inline __attribute__((always_inline)) void tile(const float *x, long ldx, const int8_t *q, long K,
                                                      const void *s, int sbf16, long n0, float *y, long ldy,
                                                      const int MT, const int R) {
    vf acc[MT_MAX][8];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[m][r] = (vf){0};
    long k = 0;
    for (; k + VW <= K; k += VW) {
        vf w[8];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) w[r] = load_q(q + r * K + k);
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            vf xv = load_x(x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) acc[m][r] += xv * w[r];
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            float t = 0.0f;
            for (int l = 0; l < VW; l++) t += acc[m][r][l];
            for (long kk = k; kk < K; kk++) t += x[m * ldx + kk] * (float)q[r * K + kk];
            y[m * ldy + r] = t * get_scale(s, sbf16, n0 + r);
        }
}

typedef void (*tile_fn)(const float *, long, const int8_t *, long, const void *, int, long, float *, long);

#define TILE_FN(MT, R)                                                                                           \
    static void tile_##MT##_##R(const float *x, long ldx, const int8_t *q, long K, const void *s, int sbf16,    \
                                long n0, float *y, long ldy) {                                                 \
        tile(x, ldx, q, K, s, sbf16, n0, y, ldy, MT, R);                                                       \
    }
#define TILE_ROW(MT) TILE_FN(MT, 1) TILE_FN(MT, 2) TILE_FN(MT, 4) TILE_FN(MT, 8)
TILE_ROW(1) TILE_ROW(2) TILE_ROW(3) TILE_ROW(4) TILE_ROW(5) TILE_ROW(6) TILE_ROW(7) TILE_ROW(8)
#define TILE_REF(MT) {tile_##MT##_1, tile_##MT##_2, tile_##MT##_4, tile_##MT##_8}
static const tile_fn TILES[MT_MAX][4] = {TILE_REF(1), TILE_REF(2), TILE_REF(3), TILE_REF(4),
                                         TILE_REF(5), TILE_REF(6), TILE_REF(7), TILE_REF(8)};

/* Output rows per block for MT rows of x: the largest of 8, 4, 2, 1 keeping MT * R accumulators in budget. */
static int rows_for(int mt) {
    int r = 8;
    while (r > 1 && mt * r > ACC_BUDGET) r /= 2;
    return r;
}

static int log2_small(int r) { return r == 8 ? 3 : r == 4 ? 2 : r == 2 ? 1 : 0; }

typedef struct {
    const float *x;
    long ldx, M, K;
    const int8_t *q;
    const void *s;
    int sbf16;
    float *y;
    long ldy, n_begin, n_end;
} job_t;

static void run_range(const job_t *j) {
    int mt_main = j->M < MT_MAX ? (int)j->M : MT_MAX;
    int R = rows_for(mt_main);
    long n = j->n_begin;
    for (; n < j->n_end; n += R) {
        int r = R;
        while (n + r > j->n_end) r /= 2;           /* the range's last rows: smaller blocks */
        for (long m0 = 0; m0 < j->M; m0 += MT_MAX) {
            int mt = j->M - m0 < MT_MAX ? (int)(j->M - m0) : MT_MAX;
            int rr = r;
            while (mt * rr > ACC_BUDGET && rr > 1) rr /= 2;
            for (int off = 0; off < r; off += rr)
                TILES[mt - 1][log2_small(rr)](j->x + m0 * j->ldx, j->ldx, j->q + (n + off) * j->K, j->K, j->s,
                                              j->sbf16, n + off, j->y + m0 * j->ldy + n + off, j->ldy);
        }
        if (r != R) R = r;                         /* stay on the smaller block size to the end */
    }
}

static void *thread_main(void *arg) {
    run_range((const job_t *)arg);
    return NULL;
}

#define MAX_THREADS 256

/* y = (x @ q^T) * scale. Returns 0, or -1 when a thread could not be started (the result is still complete:
 * the caller's thread ran that range itself). */
int localdiff_int8_mm(const float *x, long ldx, long M, long K, const int8_t *q, long N, const void *scale,
                      int scale_bf16, float *y, long ldy, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 7) / 8 * 8;                        /* ranges start on 8-row boundaries */
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int nj = 0, rc = 0;
    for (long b = 0; b < N; b += per) {
        job_t j = {x, ldx, M, K, q, scale, scale_bf16, y, ldy, b, b + per < N ? b + per : N};
        jobs[nj++] = j;
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
    return rc;
}

/* ---- AVX512-BF16 path (bf16 activations; Zen 4, Cooper Lake, Sapphire Rapids and later) ---------------------------
 * y[m, n] = scale[n] * sum_k x[m, k] * q[n, k] for bf16 x: every int8 weight is exact in bf16 (|q| <= 127 < 2^8), so
 * q is converted to bf16 once per call, NB output rows at a time, into a per-thread buffer (zeros past K), and
 * vdpbf16ps multiplies each 32-k chunk of BMT rows of x with BRT converted weight rows at a time (BMT x BRT zmm
 * accumulators: each weight chunk loaded once per BMT rows, each x chunk once per BRT weight rows). The products of two
 * bf16 are exact in fp32 and summed in fp32 (lane l of an accumulator takes k = 32c + 2l, 32c + 2l + 1 for every
 * chunk c; the 16 lanes are added at the end, then one multiplication by the scale): dequantize(q, scale) @ x^T in
 * fp32 up to the summation order (vdpbf16ps treats subnormal inputs as 0 and flushes subnormal sums to 0). Each
 * (m, n) is computed by the same instruction sequence whatever M, the tiling or the threads: rows are bit-identical
 * alone and in a batch. Measured throughput on this project's Zen 4 core: one zmm vdpbf16ps per cycle (32 MACs),
 * twice the fp32 FMA path's 16. */
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define HAVE_BF16DOT 1
#define NB 16                              /* weight rows converted per block */
#define BRT 4                              /* weight rows per micro-tile */
#define BMT 6                              /* x rows per micro-tile */

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even (finite values) */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* 32 int8 weights -> 32 bf16 (exact), in k order; `n` < 32 reads only the first n (zeros after). */
static inline __m512bh bf_load_q(const int8_t *p, long n) {
    if (n >= 32) {
        __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 16))));
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
    __mmask16 m0 = n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1);
    __mmask16 m1 = n <= 16 ? 0 : (__mmask16)((1u << (n - 16)) - 1);
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m0, p)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m1, p + 16)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* rows x K int8 weights -> bf16 [rows][kp] (kp = K rounded up to 32; zeros past K). */
static void bf_convert(const int8_t *q, long K, long kp, int rows, uint16_t *wb) {
    for (int r = 0; r < rows; r++)
        for (long k = 0; k < kp; k += 32)
            _mm512_storeu_si512((void *)(wb + r * kp + k), (__m512i)bf_load_q(q + r * K + k, K - k));
}

/* MT rows of x (bf16, row stride ldx) times RT converted weight rows (stride kp) -> y (fp32 or bf16). */
static inline __attribute__((always_inline)) void bf_tile(const uint16_t *x, long ldx, const uint16_t *w, long kp,
                                                         const int8_t *wq, long K, const void *s, int sbf16, long n0,
                                                         void *y, int ybf16, long ldy, const int MT, const int RT) {
    __m512 acc[BMT][BRT];
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++) acc[m][r] = _mm512_setzero_ps();
    const long kfull = K / 32 * 32;
    long k = 0;
    for (; k < kfull; k += 32) {
        __m512bh wv[BRT];
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++)
            wv[r] = wq ? bf_load_q(wq + r * K + k, 32) : (__m512bh)_mm512_loadu_si512((const void *)(w + r * kp + k));
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + m * ldx + k));
#pragma GCC unroll 8
            for (int r = 0; r < RT; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
    if (k < K) {                           /* the K % 32 tail: masked x, zero weights past K */
        const __mmask32 mk = (__mmask32)((1u << (K - k)) - 1);
        __m512bh wv[BRT];
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++)
            wv[r] = wq ? bf_load_q(wq + r * K + k, K - k) : (__m512bh)_mm512_loadu_si512((const void *)(w + r * kp + k));
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++) {
            __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, x + m * ldx + k);
#pragma GCC unroll 8
            for (int r = 0; r < RT; r++) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MT; m++)
#pragma GCC unroll 8
        for (int r = 0; r < RT; r++) {
            float t = _mm512_reduce_add_ps(acc[m][r]) * get_scale(s, sbf16, n0 + r);
            if (ybf16) ((uint16_t *)y)[m * ldy + n0 + r] = f32_to_bf16(t);
            else ((float *)y)[m * ldy + n0 + r] = t;
        }
}

typedef void (*bf_fn)(const uint16_t *, long, const uint16_t *, long, const int8_t *, long, const void *, int, long,
                      void *, int, long);
#define BF_FN(MT, RT)                                                                                            \
    static void bf_##MT##_##RT(const uint16_t *x, long ldx, const uint16_t *w, long kp, const int8_t *wq, long K, \
                               const void *s, int sbf16, long n0, void *y, int ybf16, long ldy) {              \
        bf_tile(x, ldx, w, kp, wq, K, s, sbf16, n0, y, ybf16, ldy, MT, RT);                                    \
    }
#define BF_ROW(MT) BF_FN(MT, 1) BF_FN(MT, 2) BF_FN(MT, 3) BF_FN(MT, 4)
BF_ROW(1) BF_ROW(2) BF_ROW(3) BF_ROW(4) BF_ROW(5) BF_ROW(6)
#define BF_REF(MT) {bf_##MT##_1, bf_##MT##_2, bf_##MT##_3, bf_##MT##_4}
static const bf_fn BF_TILES[BMT][BRT] = {BF_REF(1), BF_REF(2), BF_REF(3), BF_REF(4), BF_REF(5), BF_REF(6)};

typedef struct {
    const uint16_t *x;
    long ldx, M, K;
    const int8_t *q;
    const void *s;
    int sbf16, ybf16;
    void *y;
    long ldy, n_begin, n_end;
    int rc;
} bf_job_t;

/* Up to BRT rows of x: each weight chunk converted in registers and used at once (no buffer). Else NB weight rows
 * at a time are converted into a per-thread buffer that every micro-tile of x rows then reads. Both give the same
 * instruction sequence per (m, n): the same bits. */
static void bf_range(bf_job_t *j) {
    const long K = j->K, kp = (K + 31) / 32 * 32, M = j->M;
    const size_t ysz = j->ybf16 ? 2 : 4;
    if (M <= BRT) {
        for (long n0 = j->n_begin; n0 < j->n_end; n0 += BRT) {
            const int rt = j->n_end - n0 < BRT ? (int)(j->n_end - n0) : BRT;
            BF_TILES[M - 1][rt - 1](j->x, j->ldx, NULL, kp, j->q + n0 * K, K, j->s, j->sbf16, n0, j->y, j->ybf16,
                                    j->ldy);
        }
        return;
    }
    uint16_t *wb = aligned_alloc(64, (size_t)NB * kp * sizeof(uint16_t));
    if (!wb) {
        j->rc = -1;
        return;
    }
    /* M % BMT rows would leave a thin last tile: spread the rows evenly over ceil(M / BMT) tiles instead */
    const long tiles = (M + BMT - 1) / BMT, mt_even = (M + tiles - 1) / tiles;
    for (long n0 = j->n_begin; n0 < j->n_end; n0 += NB) {
        const int rows = j->n_end - n0 < NB ? (int)(j->n_end - n0) : NB;
        bf_convert(j->q + n0 * K, K, kp, rows, wb);
        for (int r0 = 0; r0 < rows; r0 += BRT) {
            const int rt = rows - r0 < BRT ? rows - r0 : BRT;
            for (long m0 = 0; m0 < M; m0 += mt_even) {
                const int mt = M - m0 < mt_even ? (int)(M - m0) : (int)mt_even;
                BF_TILES[mt - 1][rt - 1](j->x + m0 * j->ldx, j->ldx, wb + r0 * kp, kp, NULL, K, j->s, j->sbf16,
                                         n0 + r0, (char *)j->y + m0 * j->ldy * ysz, j->ybf16, j->ldy);
            }
        }
    }
    free(wb);
}

static void *bf_thread(void *arg) {
    bf_range((bf_job_t *)arg);
    return NULL;
}
#endif

/* 1 when this build has the AVX512-BF16 path (localdiff_int8_mm_bf16). */
int localdiff_int8_has_bf16dot(void) {
#ifdef HAVE_BF16DOT
    return 1;
#else
    return 0;
#endif
}

/* y = (x @ q^T) * scale for bf16 x (any M >= 1) by AVX512-BF16 dot products (see above); y bf16 (y_bf16 = 1) or
 * fp32. Returns 0; -2 when this build has no AVX512-BF16 (nothing written); -1 when memory ran out. */
int localdiff_int8_mm_bf16(const uint16_t *x, long ldx, long M, long K, const int8_t *q, long N, const void *scale,
                           int scale_bf16, void *y, int y_bf16, long ldy, int threads) {
#ifdef HAVE_BF16DOT
    if (M < 1 || K < 1) return -2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + NB - 1) / NB * NB;
    bf_job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0, rc = 0;
    for (long b = 0; b < N; b += per) {
        bf_job_t jb = {x, ldx, M, K, q, scale, scale_bf16, y_bf16, y, ldy, b, b + per < N ? b + per : N, 0};
        jobs[nj++] = jb;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, bf_thread, &jobs[i]) == 0;
    if (nj > 0) bf_range(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else bf_range(&jobs[i]);
    }
    for (int i = 0; i < nj; i++)
        if (jobs[i].rc) rc = jobs[i].rc;
    return rc;
#else
    (void)x; (void)ldx; (void)M; (void)K; (void)q; (void)N; (void)scale; (void)scale_bf16; (void)y; (void)y_bf16;
    (void)ldy; (void)threads;
    return -2;
#endif
}

/* ---- AMX-INT8 path (Sapphire Rapids and later; built when -march=native enables AMX) ---------------------------
 * The int8 weights go into the tiles as they are (tileloadd straight from q: 16 rows x 64 k per tile). Each row of
 * x becomes a fixed-point integer with a per-row power-of-two scale, X = round(x * 2^(27 - E)) where max|x| < 2^E
 * (so |X| <= 2^27), written as balanced base-128 digits X = d0 * 2^21 + d1 * 2^14 + d2 * 2^7 + d3 (int8, |d| <= 65).
 * tdpbssd sums d_p * q exactly in int32 per digit plane p (|sum| <= K * 65 * 128 < 2^31 for K < 258,000), the four
 * planes are combined exactly in int64 and y = that integer * 2^(E - 27) * scale is rounded once. So y is the exact
 * dot product of q with x rounded to 27 bits below its row's largest power of two: exact for bf16 activations whose
 * exponent is within 19 of the row's largest (8 significant bits), else an activation error of at most 2^-28 * 2^E
 * per element (fp32 activations: relative 2^-27 of the row's max|x|, fp32 matmul accuracy). */
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512F__)
#define HAVE_AMX 1
#include <math.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#define PLANES 4
#ifndef PF_DIST
#define PF_DIST 4                          /* prefetch distance in 64-k chunks */
#endif
#ifndef PF_HINT
#define PF_HINT _MM_HINT_T0
#endif
#define XBITS 27

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) tilecfg_t;

static int amx_state;                      /* 0 = not asked, 1 = granted, -1 = refused by the kernel */
static pthread_mutex_t amx_lock = PTHREAD_MUTEX_INITIALIZER;

static int amx_ok(void) {
    pthread_mutex_lock(&amx_lock);
    if (amx_state == 0)                    /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18) */
        amx_state = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    pthread_mutex_unlock(&amx_lock);
    return amx_state == 1;
}

typedef struct {
    const int8_t *q;
    const int8_t *bpack;                    /* [chunks][PLANES][16 quads][M][4] int8 digits */
    const int *ex;                          /* [M] row exponents E */
    long M, K;
    const void *s;
    int sbf16, ybf16;
    void *y;
    long ldy, n_begin, n_end;
} amx_job_t;

static inline uint16_t to_bf16(float f) {   /* round to nearest even (finite values) */
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* 16 output rows n0.. (weights at a, row stride lda; `kfull` k in whole 64-chunks there, the rest in tail: a
 * zero-padded [16][64] copy or NULL) into y. */
static void amx_group(const amx_job_t *j, const int8_t *a, long lda, long kfull, const int8_t *tail, long n0,
                      int rows) {
    const long M = j->M, bstep = PLANES * 16 * M * 4;
    int32_t cbuf[PLANES][16][16] __attribute__((aligned(64)));
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    long c = 0;
    for (; 64 * c < kfull; c++) {
        const int8_t *b = j->bpack + c * bstep;
        /* the hardware prefetcher alone left ~20 % of the bandwidth unused (measured: 203 -> 183 ms per pass over
         * a 1.72 GB model at 4 rows); a prefetch never faults, so reading past the rows' end is harmless */
        /* past the rows' last chunk: the same chunk of the next 16 rows, the next group's first chunks, which
         * demand loads met cold at every group start before (prefetching the rows' own bytes past their end read
         * chunks already loaded): 212 -> 182 ms per pass at 4 rows, 197 -> 168 at 1 (distance 2 -> 4; 3..8 alike) */
        const long cp = 64 * (c + PF_DIST);
        const int8_t *pa = cp < kfull ? a + cp : a + 16 * lda + cp - kfull;
        for (int i = 0; i < 16; i++) _mm_prefetch((const char *)(pa + i * lda), PF_HINT);
        _tile_loadd(4, a + 64 * c, lda);
        _tile_loadd(5, b, 4 * M);             _tile_dpbssd(0, 4, 5);
        _tile_loadd(5, b + 16 * M * 4, 4 * M); _tile_dpbssd(1, 4, 5);
        _tile_loadd(5, b + 32 * M * 4, 4 * M); _tile_dpbssd(2, 4, 5);
        _tile_loadd(5, b + 48 * M * 4, 4 * M); _tile_dpbssd(3, 4, 5);
    }
    if (tail) {
        const int8_t *b = j->bpack + c * bstep;
        _tile_loadd(4, tail, 64);
        _tile_loadd(5, b, 4 * M);             _tile_dpbssd(0, 4, 5);
        _tile_loadd(5, b + 16 * M * 4, 4 * M); _tile_dpbssd(1, 4, 5);
        _tile_loadd(5, b + 32 * M * 4, 4 * M); _tile_dpbssd(2, 4, 5);
        _tile_loadd(5, b + 48 * M * 4, 4 * M); _tile_dpbssd(3, 4, 5);
    }
    _tile_stored(0, cbuf[0], 64); _tile_stored(1, cbuf[1], 64);
    _tile_stored(2, cbuf[2], 64); _tile_stored(3, cbuf[3], 64);
    /* y[m, n0 + i] = (sum_p C_p[i][m] * 128^(3 - p)) * 2^(E_m - 27) * scale[n0 + i]: exact in int64, one double
     * product, one rounding to fp32 (then to bf16 when asked). 16 rows at a time: gathers down C's column m. */
    const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(16));
    float sc[16];
    for (int i = 0; i < 16; i++) sc[i] = i < rows ? get_scale(j->s, j->sbf16, n0 + i) : 0.0f;
    const __m512 scv = _mm512_loadu_ps(sc);
    const __m512d sc_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(scv));
    const __m512d sc_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(scv), 1)));
    const __mmask16 rmask = rows >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << rows) - 1);
    for (long m = 0; m < M; m++) {
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int p = 0; p < PLANES; p++) {
            __m512i c = _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32((int)m)), &cbuf[p][0][0], 4);
            lo = _mm512_add_epi64(_mm512_slli_epi64(lo, 7), _mm512_cvtepi32_epi64(_mm512_castsi512_si256(c)));
            hi = _mm512_add_epi64(_mm512_slli_epi64(hi, 7), _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(c, 1)));
        }
        const __m512d unit = _mm512_set1_pd(ldexp(1.0, j->ex[m] - XBITS));
        __m256 ylo = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(lo), unit), sc_lo));
        __m256 yhi = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_mul_pd(_mm512_cvtepi64_pd(hi), unit), sc_hi));
        float out[16];
        _mm256_storeu_ps(out, ylo);
        _mm256_storeu_ps(out + 8, yhi);
        if (j->ybf16) {
            uint16_t ob[16];
            for (int i = 0; i < 16; i++) ob[i] = to_bf16(out[i]);
            _mm256_mask_storeu_epi16((uint16_t *)j->y + m * j->ldy + n0, rmask, _mm256_loadu_si256((const __m256i *)ob));
        } else {
            _mm512_mask_storeu_ps((float *)j->y + m * j->ldy + n0, rmask, _mm512_loadu_ps(out));
        }
    }
}

static void amx_range(const amx_job_t *j) {
    const long M = j->M, K = j->K, kfull = K / 64 * 64, kpad = (K + 63) / 64 * 64;
    tilecfg_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = (uint16_t)(4 * M);   /* C per digit plane */
    cfg.rows[4] = 16; cfg.colsb[4] = 64;                                              /* A: weights */
    cfg.rows[5] = 16; cfg.colsb[5] = (uint16_t)(4 * M);                               /* B: digits */
    _tile_loadconfig(&cfg);
    int8_t tail[16][64] __attribute__((aligned(64)));
    long n0 = j->n_begin;
    for (; n0 + 16 <= j->n_end; n0 += 16) {
        const int8_t *a = j->q + n0 * K;
        if (kfull < K) {
            memset(tail, 0, sizeof tail);
            for (int i = 0; i < 16; i++) memcpy(tail[i], a + i * K + kfull, (size_t)(K - kfull));
        }
        amx_group(j, a, K, kfull, kfull < K ? &tail[0][0] : NULL, n0, 16);
    }
    if (n0 < j->n_end) {                     /* the last < 16 rows: a zero-padded copy */
        int rows = (int)(j->n_end - n0);
        int8_t *pad = calloc(16, (size_t)kpad);
        if (pad) {
            for (int i = 0; i < rows; i++) memcpy(pad + i * kpad, j->q + (n0 + i) * K, (size_t)K);
            amx_group(j, pad, kpad, kpad, NULL, n0, rows);
            free(pad);
        }
    }
    _tile_release();
}

static void *amx_thread(void *arg) {
    amx_range((const amx_job_t *)arg);
    return NULL;
}

static inline __m512 load16(const void *x, int xbf16, long off, __mmask16 mk) {
    if (xbf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mk, (const uint16_t *)x + off)), 16));
    return _mm512_maskz_loadu_ps(mk, (const float *)x + off);
}

/* Row exponents and the digit planes of x in the tiles' quad layout (zeros past K), 16 elements at a time. */
static void pack_x(const void *x, int xbf16, long ldx, long M, long K, int *ex, int8_t *out) {
    const long chunks = (K + 63) / 64;
    for (long m = 0; m < M; m++) {
        __m512 mx = _mm512_setzero_ps();
        for (long k = 0; k < K; k += 16) {
            __mmask16 mk = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, xbf16, m * ldx + k, mk)));
        }
        float top = _mm512_reduce_max_ps(mx);
        int e = 0;
        if (top > 0.0f) frexpf(top, &e);
        if (e < XBITS - 126) e = XBITS - 126;   /* keeps 2^(XBITS - e) a finite float (tiny rows round to 0) */
        ex[m] = e;
        const __m512 mul = _mm512_set1_ps(ldexpf(1.0f, XBITS - e));
        for (long k = 0; k < chunks * 64; k += 16) {
            __mmask16 mk = k >= K ? 0 : K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, xbf16, m * ldx + k, mk), mul));  /* exact *2^j, RNE */
            __m512i d[PLANES];
            for (int p = PLANES - 1; p > 0; p--) {
                d[p] = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(v, _mm512_set1_epi32(64)),
                                                         _mm512_set1_epi32(127)), _mm512_set1_epi32(64));
                v = _mm512_srai_epi32(_mm512_sub_epi32(v, d[p]), 7);
            }
            d[0] = v;
            long c = k / 64, r0 = (k % 64) / 4;
            for (int p = 0; p < PLANES; p++) {
                int8_t b[16];
                _mm_storeu_si128((__m128i *)b, _mm512_cvtepi32_epi8(d[p]));
                int8_t *dst = out + (((c * PLANES + p) * 16 + r0) * M + m) * 4;
                for (int r = 0; r < 4; r++) memcpy(dst + r * M * 4, b + 4 * r, 4);
            }
        }
    }
}
#endif

/* 1 when the AMX path can run in this process (built with AMX-INT8 and the kernel granted the tile state). */
int localdiff_int8_has_amx(void) {
#ifdef HAVE_AMX
    return amx_ok();
#else
    return 0;
#endif
}

/* y = (x @ q^T) * scale by AMX-INT8 for 1 <= M <= 16 (see above); x bf16 (x_bf16 = 1) or fp32, y bf16 (y_bf16 = 1)
 * or fp32. Returns 0; -2 when this build or process has no AMX (nothing written); -1 when memory ran out. */
int localdiff_int8_mm_amx(const void *x, int x_bf16, long ldx, long M, long K, const int8_t *q, long N,
                          const void *scale, int scale_bf16, void *y, int y_bf16, long ldy, int threads) {
#ifdef HAVE_AMX
    if (!amx_ok() || M < 1 || M > 16 || K < 1) return -2;
    long chunks = (K + 63) / 64;
    int8_t *bpack = malloc((size_t)chunks * PLANES * 16 * M * 4);
    int ex[16];
    if (!bpack) return -1;
    pack_x(x, x_bf16, ldx, M, K, ex, bpack);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    long per = (N + threads - 1) / threads;
    per = (per + 15) / 16 * 16;
    amx_job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS], nj = 0;
    for (long b = 0; b < N; b += per) {
        amx_job_t jb = {q, bpack, ex, M, K, scale, scale_bf16, y_bf16, y, ldy, b, b + per < N ? b + per : N};
        jobs[nj++] = jb;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, amx_thread, &jobs[i]) == 0;
    if (nj > 0) amx_range(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else amx_range(&jobs[i]);
    }
    free(bpack);
    return 0;
#else
    (void)x; (void)x_bf16; (void)ldx; (void)M; (void)K; (void)q; (void)N; (void)scale; (void)scale_bf16;
    (void)y; (void)y_bf16; (void)ldy; (void)threads;
    return -2;
#endif
}

/* Vector width in floats this build uses (for the caller's log line). */
int localdiff_int8_vector_width(void) { return VW; }
