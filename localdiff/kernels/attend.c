/* localdiff: attention of a few query rows over a bf16 K/V cache (decoding steps), for CPUs with AVX512-BF16.
 *
 * out[b, i, h*D + d] = sum_l p[l] v[b, h/G, l, d],  p = softmax_l(scale * q[b, h, i, :] . k[b, h/G, l, :]) over the
 * keys l the key mask allows (GQA: query head h reads key-value head h / G, G = H / Hkv), as
 * torch.nn.functional.scaled_dot_product_attention computes it (docs/ARCHITECTURE.md, the dense layer). Numerics:
 * q . k by vdpbf16ps (bf16 products exact in fp32, fp32 sums), softmax in fp32 (Cephes expf reduction and
 * polynomial, ~2 ulp), the weighted sum of V in fp32 with fp32 weights, one rounding of the result to bf16 (to
 * nearest even). Torch's CPU flash kernel rounds the weights p to bf16 before its P.V product; this one does not, so
 * it is at least as close to a float64 computation (tests/arch/test_attend_native.py).
 *
 * K and V are read in place (any head / row strides, rows of D contiguous elements): a cache's views need no copy.
 * The (batch, key-value head) pairs are split over `threads` pthreads (the caller runs the first share).
 * Python side: localdiff/kernels/attend.py.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_BF16 1
#endif

#define MAX_THREADS 64

/* 1 when this build has the kernel (AVX512-BF16); else every call returns -3. */
int localdiff_attend_available(void) {
#ifdef HAVE_BF16
    return 1;
#else
    return 0;
#endif
}

typedef struct {
    const uint16_t *q, *k, *v;
    long qsb, qsh, qsl, ksb, ksh, ksl, vsb, vsh, vsl;
    const uint8_t *mask;
    long msb;
    uint16_t *out;
    long H, Hkv, n, L, D;
    float scale;
    long p0, p1;                           /* this job's (b, kv head) pairs */
    int rc;
} job_t;

#ifdef HAVE_BF16
static inline __m512 v_exp(__m512 x) {  /* Cephes expf: n = round(x log2 e), r = x - n ln 2, degree-5 polynomial */
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365478515625f), _CMP_LT_OQ);
    return _mm512_maskz_scalef_ps(~tiny, y, n);
}

/* bf16 bits of 16 fp32 lanes in the low (hi = 0) or high (hi = 1) half of each 32-bit lane, rounded to nearest even
 * as torch's fp32 -> bf16 cast (the result is finite here: softmax weights times finite values). */
static inline __m512i round_bf16(__m512 f, const int hi) {
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    return hi ? _mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)) : _mm512_srli_epi32(u, 16);
}

/* Lane t of the result = the sum of a[t]'s 16 lanes (a transposing reduction tree: 45 instructions for 16 sums). */
static inline __m512 sum16(__m512 a[16]) {
    __m512 t[8], u[4], w[2];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

/* One (b, kv head) pair: the G * n query rows sharing its keys. D = 32 * C (compile-time C after inlining). */
static inline __attribute__((always_inline)) int pair(const job_t *j, long b, long kh, float *s, const int C) {
    const long G = j->H / j->Hkv, n = j->n, L = j->L, R = G * n, D = j->D;
    const uint16_t *k = j->k + b * j->ksb + kh * j->ksh, *v = j->v + b * j->vsb + kh * j->vsh;
    const uint8_t *mask = j->mask ? j->mask + b * j->msb : NULL;
    /* scores s[r][l], r = g * n + i (query head kh * G + g, row i): 16 keys at a time, 16 independent sums */
    for (long r = 0; r < R; r++) {
        const uint16_t *q = j->q + b * j->qsb + (kh * G + r / n) * j->qsh + (r % n) * j->qsl;
        __m512i qc[8];
        for (int c = 0; c < C; c++) qc[c] = _mm512_loadu_si512((const void *)(q + 32 * c));
        long l = 0;
        for (; l + 16 <= L; l += 16) {
            __m512 a[16];
            for (int t = 0; t < 16; t++) {
                a[t] = _mm512_setzero_ps();
                for (int c = 0; c < C; c++)
                    a[t] = _mm512_dpbf16_ps(a[t], (__m512bh)qc[c],
                                            (__m512bh)_mm512_loadu_si512((const void *)(k + (l + t) * j->ksl + 32 * c)));
            }
            _mm512_storeu_ps(s + r * L + l, _mm512_mul_ps(sum16(a), _mm512_set1_ps(j->scale)));
        }
        for (; l < L; l++) {
            __m512 acc = _mm512_setzero_ps();
            for (int c = 0; c < C; c++)
                acc = _mm512_dpbf16_ps(acc, (__m512bh)qc[c], (__m512bh)_mm512_loadu_si512((const void *)(k + l * j->ksl + 32 * c)));
            s[r * L + l] = _mm512_reduce_add_ps(acc) * j->scale;
        }
    }
    /* softmax weights (unnormalised) in place; masked keys weigh 0 */
    float inv[64];
    for (long r = 0; r < R; r++) {
        float *sr = s + r * L;
        float m = -INFINITY;
        for (long l = 0; l < L; l++)
            if ((!mask || mask[l]) && sr[l] > m) m = sr[l];
        if (m == -INFINITY) return -4;                    /* no visible key: the caller falls back */
        __m512 vm = _mm512_set1_ps(m), sum = _mm512_setzero_ps();
        for (long l = 0; l < L; l += 16) {
            __mmask16 km = L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1);
            if (mask) km &= (__mmask16)_mm_cmpneq_epi8_mask(_mm_maskz_loadu_epi8(km, mask + l), _mm_setzero_si128());
            __m512 e = _mm512_maskz_mov_ps(km, v_exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(km, sr + l), vm)));
            sum = _mm512_add_ps(sum, e);
            _mm512_mask_storeu_ps(sr + l, L - l >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L - l)) - 1), e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    /* out = p . V in fp32, two query rows at a time; V's 32 bf16 of a chunk split into even / odd lanes */
    const __m512i hi_mask = _mm512_set1_epi32((int)0xFFFF0000u);
    for (long r0 = 0; r0 < R; r0 += 2) {
        const int rb = R - r0 >= 2 ? 2 : 1;
        __m512 ae[2][8], ao[2][8];
        for (int t = 0; t < 2; t++)
            for (int c = 0; c < C; c++) ae[t][c] = ao[t][c] = _mm512_setzero_ps();
        const float *s0 = s + r0 * L, *s1 = s + (r0 + rb - 1) * L;
        for (long l = 0; l < L; l++) {
            if (mask && !mask[l]) continue;
            const __m512 p0 = _mm512_set1_ps(s0[l]), p1 = _mm512_set1_ps(s1[l]);
            for (int c = 0; c < C; c++) {
                const __m512i w = _mm512_loadu_si512((const void *)(v + l * j->vsl + 32 * c));
                const __m512 ve = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
                const __m512 vo = _mm512_castsi512_ps(_mm512_and_si512(w, hi_mask));
                ae[0][c] = _mm512_fmadd_ps(p0, ve, ae[0][c]);
                ao[0][c] = _mm512_fmadd_ps(p0, vo, ao[0][c]);
                if (rb == 2) {
                    ae[1][c] = _mm512_fmadd_ps(p1, ve, ae[1][c]);
                    ao[1][c] = _mm512_fmadd_ps(p1, vo, ao[1][c]);
                }
            }
        }
        for (int t = 0; t < rb; t++) {
            const long r = r0 + t, h = kh * G + r / n, i = r % n;
            uint16_t *o = j->out + (b * n + i) * j->H * D + h * D;
            const __m512 sc = _mm512_set1_ps(inv[r]);
            for (int c = 0; c < C; c++) {
                __m512i e = round_bf16(_mm512_mul_ps(ae[t][c], sc), 0);
                __m512i od = round_bf16(_mm512_mul_ps(ao[t][c], sc), 1);
                _mm512_storeu_si512((void *)(o + 32 * c), _mm512_or_si512(e, od));
            }
        }
    }
    return 0;
}

static void *run_job(void *arg) {
    job_t *j = (job_t *)arg;
    const long R = (j->H / j->Hkv) * j->n;
    float *s = malloc((size_t)(R * j->L > 0 ? R * j->L : 1) * sizeof(float));
    if (!s) {
        j->rc = -2;
        return NULL;
    }
    for (long p = j->p0; p < j->p1 && !j->rc; p++) {
        const long b = p / j->Hkv, kh = p % j->Hkv;
        switch (j->D) {
            case 64: j->rc = pair(j, b, kh, s, 2); break;
            case 128: j->rc = pair(j, b, kh, s, 4); break;
            default: j->rc = pair(j, b, kh, s, 8); break;
        }
    }
    free(s);
    return NULL;
}
#endif

/* out [B, n, H * D] bf16 bits (contiguous) = attention of q [B, H, n, D] over k, v [B, Hkv, L, D] (bf16 bits; element
 * strides per batch / head / row given, rows contiguous); mask: uint8 [B, L] (row stride msb; 0 = the key is not
 * attended to) or NULL (all keys). Returns 0; -1 bad shape (D not 64 / 128 / 256, H not a multiple of Hkv,
 * G * n > 64); -2 out of memory; -3 no AVX512-BF16 in this build; -4 a query row sees no key (out incomplete). */
int localdiff_attend(const uint16_t *q, long qsb, long qsh, long qsl, const uint16_t *k, long ksb, long ksh, long ksl,
                     const uint16_t *v, long vsb, long vsh, long vsl, const uint8_t *mask, long msb, uint16_t *out,
                     long B, long H, long Hkv, long n, long L, long D, float scale, int threads) {
#ifndef HAVE_BF16
    (void)q; (void)qsb; (void)qsh; (void)qsl; (void)k; (void)ksb; (void)ksh; (void)ksl; (void)v; (void)vsb;
    (void)vsh; (void)vsl; (void)mask; (void)msb; (void)out; (void)B; (void)H; (void)Hkv; (void)n; (void)L; (void)D;
    (void)scale; (void)threads;
    return -3;
#else
    if ((D != 64 && D != 128 && D != 256) || Hkv < 1 || H % Hkv || (H / Hkv) * n > 64 || n < 1 || L < 1)
        return -1;
    const long P = B * Hkv;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > P) threads = (int)P;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    const long per = (P + threads - 1) / threads;
    int nj = 0;
    for (long p = 0; p < P; p += per) {
        job_t jb = {q, k, v, qsb, qsh, qsl, ksb, ksh, ksl, vsb, vsh, vsl, mask, msb, out, H, Hkv, n, L, D, scale,
                    p, p + per < P ? p + per : P, 0};
        jobs[nj++] = jb;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, run_job, &jobs[i]) == 0;
    run_job(&jobs[0]);
    int rc = jobs[0].rc;
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else run_job(&jobs[i]);
        if (jobs[i].rc && !rc) rc = jobs[i].rc;
    }
    return rc;
#endif
}
