// Shared by the CPU kernels: the bf16 storage type and its vector store.
#pragma once

#include <immintrin.h>
#include <cstdint>

typedef uint16_t bf16;

// 16 fp32 -> 16 bf16 (round to nearest even).
inline void store_bf16(bf16* dst, __m512 a) { _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(a)); }

extern "C" int tabfm_cpu_kernels_supported();
