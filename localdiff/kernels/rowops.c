/* localdiff: the per-row bf16 ops of a dense layer in one pass each (RMSNorm; Qwen3's per-head q/k RMSNorm + RoPE),
 * rounding where torch's bf16 ops round, so that results equal the torch ops of localdiff/arch/dense.py:
 *
 *   llama_rms_norm(x, w, eps): xf = fp32(x); r = 1 / sqrt(sum(xf^2) / D + eps); y = bf16(xf * r);
 *                               out = w ? bf16(fp32(y) * fp32(w)) : y
 *   apply_rope(x, cos, sin) (bf16, full rotary): c = bf16(cos), s = bf16(sin), rot = cat(-x2, x1);
 *                               out = bf16(fp32(bf16(x * c)) + fp32(bf16(rot * s)))
 *
 * The only difference is the order of the sum of squares (16 partial sums here; torch's vectorised reduction has
 * its own): r may differ in its last bit, and then an output in its last bf16 bit (rarely; tests/arch/test_rowops.py).
 * Plain C (the compiler vectorises the element loops; -O3 without fast-math keeps every rounding as written).
 * Python side: localdiff/kernels/rowops.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* fp32 -> bf16 bits, to nearest even (torch's cast; NaN -> quiet NaN). */
static inline uint16_t rb(float v) {
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* 1 / sqrt(mean(x^2) + eps) of D bf16 values. */
static inline float inv_rms(const uint16_t *x, long D, float eps) {
    float acc[16] = {0};
    long d = 0;
    for (; d + 16 <= D; d += 16)
        for (int i = 0; i < 16; i++) {
            float f = bf(x[d + i]);
            acc[i] += f * f;
        }
    for (; d < D; d++) {
        float f = bf(x[d]);
        acc[d & 15] += f * f;
    }
    for (int s = 8; s > 0; s /= 2)
        for (int i = 0; i < s; i++) acc[i] += acc[i + s];
    return 1.0f / sqrtf(acc[0] / (float)D + eps);
}

/* out[r] = RMSNorm(x[r]) (times w when w is not NULL), rows of D bf16 values; row strides ldx / ldo. Returns 0. */
int localdiff_rms_norm_bf16(const uint16_t *x, long rows, long D, long ldx, const uint16_t *w, float eps,
                            uint16_t *out, long ldo) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * ldx;
        uint16_t *o = out + r * ldo;
        const float inv = inv_rms(xr, D, eps);
        if (w)
            for (long d = 0; d < D; d++) o[d] = rb(bf(rb(bf(xr[d]) * inv)) * bf(w[d]));
        else
            for (long d = 0; d < D; d++) o[d] = rb(bf(xr[d]) * inv);
    }
    return 0;
}

/* Qwen3's q/k path on a fused q/k/v row: heads 0 .. hq - 1 (q, weight wq) and hq .. hq + hk - 1 (k, weight wk) of D
 * values each at x[t * ldx + h * D] are RMS-normed, scaled and rotated by RoPE (fp32 tables cos / sin [n, D], row t
 * for token t), into out[t, h, :] (contiguous [n, hq + hk, D]). D even. Returns 0; -1 for odd D or D > 512. */
int localdiff_qk_norm_rope_bf16(const uint16_t *x, long n, long ldx, long hq, long hk, long D, const uint16_t *wq,
                                const uint16_t *wk, float eps, const float *cos, const float *sin, uint16_t *out) {
    if (D % 2 || D > 512) return -1;
    const long half = D / 2;
    uint16_t y[512];
    float c[512], s[512];
    for (long t = 0; t < n; t++) {
        for (long d = 0; d < D; d++) c[d] = bf(rb(cos[t * D + d])), s[d] = bf(rb(sin[t * D + d]));
        for (long h = 0; h < hq + hk; h++) {
            const uint16_t *xh = x + t * ldx + h * D, *w = h < hq ? wq : wk;
            uint16_t *o = out + (t * (hq + hk) + h) * D;
            const float inv = inv_rms(xh, D, eps);
            for (long d = 0; d < D; d++) y[d] = rb(bf(rb(bf(xh[d]) * inv)) * bf(w[d]));
            for (long d = 0; d < half; d++) {
                o[d] = rb(bf(rb(bf(y[d]) * c[d])) + bf(rb(-bf(y[d + half]) * s[d])));
                o[d + half] = rb(bf(rb(bf(y[d + half]) * c[d + half])) + bf(rb(bf(y[d]) * s[d + half])));
            }
        }
    }
    return 0;
}
