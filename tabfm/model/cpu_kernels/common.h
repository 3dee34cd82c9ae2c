// Shared by the CPU kernels: the bf16 storage type, its vector loads / stores, a vector exp.
#pragma once

#include <immintrin.h>
#include <cstdint>

typedef uint16_t bf16;

// 16 fp32 -> 16 bf16 (round to nearest even).
inline void store_bf16(bf16* dst, __m512 a) { _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(a)); }

// Lanes j.. of a row of n values that exist: all 16, or the tail.
inline __mmask16 tail(int64_t n, int64_t j) { return n - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - j)) - 1); }

// The lanes m of 16 bf16 -> fp32 (exact), zeros elsewhere.
inline __m512 load_bf16(const bf16* src, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
}

// exp on [-88, 88] (clamped): 2^n * p(r), r = x - n ln 2, degree-6 Taylor (rel. error ~2e-7).
inline __m512 exp512(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.0f)), _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

extern "C" int tabfm_cpu_kernels_supported();
