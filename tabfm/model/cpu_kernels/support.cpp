// Whether this CPU runs the kernels (they use AVX512-F/BW/VL and AVX512-BF16).
#include "common.h"

extern "C" int tabfm_cpu_kernels_supported() {
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}
