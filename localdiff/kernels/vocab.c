/* One fused pass over a denoising step's vocabulary-sized work (issue #24), per row of logits:
 *
 *   z = cap * tanh(x / cap)          (soft-capping; skipped when cap == 0)
 *   y = z * inv_temp                 (temperature)
 *   m = max y, a = first argmax y
 *   e = exp(y - m), s = sum e, t = sum e * (y - m)
 *   entropy = log s - t / s (nats, clamped >= 0), confidence = 1 / s (top-1 probability)
 *   probs = e / s, written once as bf16 (round to nearest even) or fp32
 *
 * The row goes through a per-thread fp32 scratch row (V floats, kept in L2 between the three passes), so the logits
 * are read once from memory and the probabilities written once: 4 bytes per element for bf16 in and out, against
 * 92 for the torch passes (localdiff/bench/roofline.py).
 *
 * exp: Cephes expf range reduction (n = round(x log2 e), r = x - n ln 2 in two parts) and its degree-5 polynomial,
 * ~2 ulp; results below exp(-87.3) are 0. tanh(u) = sign(u) (1 - q) / (1 + q) with q = exp(-2|u|): absolute error
 * ~1e-7, so the soft-capped logit is off by ~cap * 1e-7. Sums are fp32 over 4 x 16 (AVX-512) or 4 (portable) lanes.
 * Measured against float64 in tests/decoding/test_vocab_native.py.
 *
 * Build: plain C99, AVX-512F/BW (+VL) intrinsics when the compiler targets them (-march=native on such a CPU), the
 * same math in portable scalar code otherwise. Threads: rows split into contiguous ranges (pthreads per call).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define LD_AVX512 1
#else
#define LD_AVX512 0
#endif

#define MAX_THREADS 256
#define EXP_LO (-87.33654f)
#define EXP_HI 88.37626f

typedef struct {
    const void *in; int in_bf16; long in_stride; long r0, r1, V;
    float cap, inv_temp;
    void *out; int out_bf16; long out_stride;
    int64_t *argmax; float *entropy, *conf;
    float *scratch;
} job_t;

int localdiff_vocab_vector_width(void) { return LD_AVX512 ? 16 : 1; }

/* ---- scalar math (the portable build, and the reference for the vector code) ---- */
static inline float ld_bf16_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t ld_f32_bf16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static inline float ld_exp(float x) {
    if (x < EXP_LO) return 0.0f;
    if (x > EXP_HI) x = EXP_HI;
    float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f; p = p * r + 8.3334519073e-3f; p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f; p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    uint32_t b = (uint32_t)((int32_t)n + 127) << 23; float s; memcpy(&s, &b, 4);
    return y * s;
}
static inline float ld_tanh(float u) {
    float q = ld_exp(-2.0f * fabsf(u));
    return copysignf((1.0f - q) / (1.0f + q), u);
}

static void row_scalar(const job_t *j, long r) {
    const long V = j->V;
    float *w = j->scratch;
    float m = -INFINITY; long a = 0;
    const float inv_cap = j->cap > 0 ? 1.0f / j->cap : 0.0f;
    for (long i = 0; i < V; i++) {
        float x = j->in_bf16 ? ld_bf16_f32(((const uint16_t *)j->in)[r * j->in_stride + i])
                             : ((const float *)j->in)[r * j->in_stride + i];
        if (j->cap > 0) x = j->cap * ld_tanh(x * inv_cap);
        x *= j->inv_temp;
        w[i] = x;
        if (x > m) { m = x; a = i; }
    }
    float s[4] = {0, 0, 0, 0}, t[4] = {0, 0, 0, 0};
    for (long i = 0; i < V; i++) {
        float d = w[i] - m, e = ld_exp(d);
        s[i & 3] += e; t[i & 3] += e * d; w[i] = e;
    }
    double S = (double)((s[0] + s[1]) + (s[2] + s[3])), T = (double)((t[0] + t[1]) + (t[2] + t[3]));
    float inv = (float)(1.0 / S);
    if (j->out_bf16) {
        uint16_t *o = (uint16_t *)j->out + r * j->out_stride;
        for (long i = 0; i < V; i++) o[i] = ld_f32_bf16(w[i] * inv);
    } else {
        float *o = (float *)j->out + r * j->out_stride;
        for (long i = 0; i < V; i++) o[i] = w[i] * inv;
    }
    double h = log(S) - T / S;
    j->argmax[r] = a; j->entropy[r] = (float)(h > 0 ? h : 0); j->conf[r] = (float)(1.0 / S);
}

#if LD_AVX512
static inline __m512 v_exp(__m512 x) {   /* the same reduction and polynomial; 2^n applied by scalef (0 far below) */
    x = _mm512_min_ps(x, _mm512_set1_ps(EXP_HI));
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
    __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_LO), _CMP_LT_OQ);
    return _mm512_maskz_scalef_ps(~zero, y, n);
}
static inline __m512 v_tanh(__m512 u) {
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 au = _mm512_abs_ps(u);
    __m512 q = v_exp(_mm512_mul_ps(au, _mm512_set1_ps(-2.0f)));
    __m512 t = _mm512_div_ps(_mm512_sub_ps(one, q), _mm512_add_ps(one, q));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(u), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}
static inline __m512 v_load(const job_t *j, long r, long i, __mmask16 k) {
    if (j->in_bf16) {
        __m256i h = _mm256_maskz_loadu_epi16(k, (const uint16_t *)j->in + r * j->in_stride + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_maskz_loadu_ps(k, (const float *)j->in + r * j->in_stride + i);
}
static inline __m256i v_bf16(__m512 f) {   /* round to nearest even; inputs here are finite */
    __m512i u = _mm512_castps_si512(f);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

static void row_avx512(const job_t *j, long r) {
    const long V = j->V;
    float *w = j->scratch;
    const int cap = j->cap > 0;
    const __m512 vcap = _mm512_set1_ps(j->cap), vinv_cap = _mm512_set1_ps(cap ? 1.0f / j->cap : 0.0f);
    const __m512 vt = _mm512_set1_ps(j->inv_temp);
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    __m512i vidx = _mm512_setzero_si512(), lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                     14, 15);
    for (long i = 0; i < V; i += 16) {
        __mmask16 k = V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1);
        __m512 x = v_load(j, r, i, k);
        if (cap) x = _mm512_mul_ps(vcap, v_tanh(_mm512_mul_ps(x, vinv_cap)));
        x = _mm512_mul_ps(x, vt);
        _mm512_mask_storeu_ps(w + i, k, x);
        __mmask16 gt = _mm512_mask_cmp_ps_mask(k, x, vmax, _CMP_GT_OQ);
        vmax = _mm512_mask_mov_ps(vmax, gt, x);
        vidx = _mm512_mask_mov_epi32(vidx, gt, _mm512_add_epi32(lane, _mm512_set1_epi32((int)i)));
    }
    float m = _mm512_reduce_max_ps(vmax);
    __mmask16 at = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
    long a = _mm512_mask_reduce_min_epi32(at, vidx);
    const __m512 vm = _mm512_set1_ps(m);
    __m512 s[4], t[4];
    for (int q = 0; q < 4; q++) { s[q] = _mm512_setzero_ps(); t[q] = _mm512_setzero_ps(); }
    long i = 0;
    for (; i + 64 <= V; i += 64) {
        for (int q = 0; q < 4; q++) {
            __m512 d = _mm512_sub_ps(_mm512_loadu_ps(w + i + 16 * q), vm), e = v_exp(d);
            s[q] = _mm512_add_ps(s[q], e); t[q] = _mm512_fmadd_ps(e, d, t[q]);
            _mm512_storeu_ps(w + i + 16 * q, e);
        }
    }
    for (; i < V; i += 16) {
        __mmask16 k = V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1);
        __m512 d = _mm512_maskz_sub_ps(k, _mm512_maskz_loadu_ps(k, w + i), vm), e = _mm512_maskz_mov_ps(k, v_exp(d));
        s[0] = _mm512_add_ps(s[0], e); t[0] = _mm512_fmadd_ps(e, d, t[0]);
        _mm512_mask_storeu_ps(w + i, k, e);
    }
    double S = (double)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s[0], s[1]), _mm512_add_ps(s[2], s[3])));
    double T = (double)_mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(t[0], t[1]), _mm512_add_ps(t[2], t[3])));
    const __m512 vinv = _mm512_set1_ps((float)(1.0 / S));
    for (i = 0; i < V; i += 16) {
        __mmask16 k = V - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (V - i)) - 1);
        __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, w + i), vinv);
        if (j->out_bf16) _mm256_mask_storeu_epi16((uint16_t *)j->out + r * j->out_stride + i, k, v_bf16(p));
        else _mm512_mask_storeu_ps((float *)j->out + r * j->out_stride + i, k, p);
    }
    double h = log(S) - T / S;
    j->argmax[r] = a; j->entropy[r] = (float)(h > 0 ? h : 0); j->conf[r] = (float)(1.0 / S);
}
#endif

static void *run_rows(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (long r = j->r0; r < j->r1; r++) {
#if LD_AVX512
        row_avx512(j, r);
#else
        row_scalar(j, r);
#endif
    }
    return NULL;
}

/* The pass over `rows` rows of V logits (bf16 when in_bf16, else fp32; row stride in_stride elements, unit stride
 * along V). Writes probs (bf16 when out_bf16, else fp32; row stride out_stride), argmax (int64), entropy (fp32,
 * nats) and conf (fp32) per row. scratch: threads * V floats. cap <= 0: no soft-capping. Returns 0. */
int localdiff_vocab_pass(const void *in, int in_bf16, long in_stride, long rows, long V, float cap, float inv_temp,
                         void *out, int out_bf16, long out_stride, int64_t *argmax, float *entropy, float *conf,
                         float *scratch, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = rows > 0 ? (int)rows : 1;
    long per = (rows + threads - 1) / threads;
    job_t jobs[MAX_THREADS];
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    int nj = 0;
    for (long r0 = 0; r0 < rows; r0 += per, nj++) {
        job_t j = {in, in_bf16, in_stride, r0, r0 + per < rows ? r0 + per : rows, V, cap, inv_temp, out, out_bf16,
                   out_stride, argmax, entropy, conf, scratch + (long)nj * V};
        jobs[nj] = j;
    }
    for (int i = 1; i < nj; i++) started[i] = pthread_create(&tid[i], NULL, run_rows, &jobs[i]) == 0;
    if (nj) run_rows(&jobs[0]);
    for (int i = 1; i < nj; i++) {
        if (started[i]) pthread_join(tid[i], NULL);
        else run_rows(&jobs[i]);
    }
    return 0;
}
