// RMSNorm of an fp32 residual stream with a bf16 output, forward and backward, for x86 CPUs
// with AVX512-BF16.
//
// Why: under bf16 autocast on CPU, torch computes RMSNorm as ~6 separate fp32 passes (pow,
// mean, rsqrt, two muls; more in the backward) and the next Linear then casts the result to
// bf16 in one more pass; in a tiny train step these passes cost as much as all the
// attention. Here one pass reads x and writes y = bf16(x * rstd * w); the backward is one
// pass over x and dy.
//
// x (rows, d) fp32, w (d) fp32, y (rows, d) bf16, rstd (rows) fp32 = 1 / sqrt(mean(x^2) + eps).
// Backward: g = dy * w; dx = rstd * g - x * rstd^3 * (g . x) / d; dw += dy * x * rstd (summed
// into the caller's dw, one buffer per thread). Rows [begin, end); d any size.

#include "common.h"

#include <cmath>

extern "C" {

void tabfm_rms_norm_bf16_fwd(const float* x, const float* w, bf16* y, float* rstd, int64_t begin, int64_t end,
                             int64_t d, float eps) {
    for (int64_t r = begin; r < end; ++r) {
        const float* xr = x + r * d;
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail(d, j), xr + j);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        const float rs = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / float(d) + eps);
        rstd[r] = rs;
        const __m512 vr = _mm512_set1_ps(rs);
        for (int64_t j = 0; j < d; j += 16) {
            const __mmask16 m = tail(d, j);
            const __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xr + j), vr), _mm512_maskz_loadu_ps(m, w + j));
            _mm256_mask_storeu_epi16(y + r * d + j, m, (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}

void tabfm_rms_norm_bf16_bwd(const float* x, const float* w, const float* rstd, const bf16* dy, float* dx, float* dw,
                             int64_t begin, int64_t end, int64_t d) {
    for (int64_t r = begin; r < end; ++r) {
        const float* xr = x + r * d;
        const bf16* dyr = dy + r * d;
        const float rs = rstd[r];
        __m512 acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < d; j += 16) {
            const __mmask16 m = tail(d, j);
            const __m512 g = _mm512_mul_ps(load_bf16(dyr + j, m), _mm512_maskz_loadu_ps(m, w + j));
            acc = _mm512_fmadd_ps(g, _mm512_maskz_loadu_ps(m, xr + j), acc);
        }
        const __m512 c = _mm512_set1_ps(rs * rs * rs * _mm512_reduce_add_ps(acc) / float(d));
        const __m512 vr = _mm512_set1_ps(rs);
        for (int64_t j = 0; j < d; j += 16) {
            const __mmask16 m = tail(d, j);
            const __m512 xv = _mm512_maskz_loadu_ps(m, xr + j);
            const __m512 dyv = load_bf16(dyr + j, m);
            const __m512 g = _mm512_mul_ps(dyv, _mm512_maskz_loadu_ps(m, w + j));
            _mm512_mask_storeu_ps(dx + r * d + j, m, _mm512_fnmadd_ps(xv, c, _mm512_mul_ps(g, vr)));
            _mm512_mask_storeu_ps(dw + j, m, _mm512_fmadd_ps(_mm512_mul_ps(dyv, xv), vr, _mm512_maskz_loadu_ps(m, dw + j)));
        }
    }
}

}  // extern "C"
