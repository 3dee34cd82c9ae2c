// Fused bf16 attention for x86 CPUs with AVX512-BF16 (forward and backward).
//
// Why: on CPU, torch's flash attention runs in fp32 and its backward reaches ~30-50 GFLOP/s,
// while a bf16 matmul reaches ~200. The model's attentions are short (columns of a row; the
// key rows of a column), so one (sequence, head) slice fits in L2: this kernel computes a
// slice's scores in full, in fp32, with AVX512-BF16 dot products, and never writes them to
// memory outside the slice's scratch.
//
// Layout: q (N, H, L, D), k and v (N, H, S, D), bf16 (uint16), contiguous; D even. The
// optional key mask is (N, S) uint8, 1 = key visible, broadcast over heads and queries.
// Forward writes o (N, H, L, D) bf16 and the log-sum-exp lse (N, H, L) fp32 (+inf for a
// row without any visible key: its output and gradients are zero). Each call handles the
// slices [begin, end) of the N*H (sequence, head) slices, so callers can split the work.
//
// Every product is C = A * B with A row-major bf16 (pairs along the reduction adjacent)
// and B packed as [k/2][n][2] (the operand layout of vdpbf16ps), fp32 accumulation.

#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include <algorithm>

typedef uint16_t bf16;

namespace {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

inline bf16 float_to_bf16(float f) {  // round to nearest even (finite inputs)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return bf16(u >> 16);
}

// ---------------------------------------------------------------- GEMM micro-kernels
// C[MR x 16*NR] = A[MR x 2*Kp] * Bp, Bp already offset to the first column (row stride 2*ldb).
template <int MR, int NR>
inline void ukernel(const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < Kp; ++kp) {
        __m512i b[NR];
        for (int r = 0; r < NR; ++r) b[r] = _mm512_loadu_si512((const void*)(Bp + (kp * ldb + 16 * r) * 2));
        for (int i = 0; i < MR; ++i) {
            int32_t a;
            std::memcpy(&a, A + i * lda + 2 * kp, 4);
            __m512i av = _mm512_set1_epi32(a);
            for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], (__m512bh)av, (__m512bh)b[r]);
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) _mm512_storeu_ps(C + i * ldc + 16 * r, acc[i][r]);
}

template <int MR, int NR>
struct Rows {  // dispatch a row remainder m <= MR to the kernel of exactly m rows
    static void run(int m, const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc) {
        if (m == MR) ukernel<MR, NR>(A, lda, Bp, ldb, Kp, C, ldc);
        else Rows<MR - 1, NR>::run(m, A, lda, Bp, ldb, Kp, C, ldc);
    }
};
template <int NR>
struct Rows<0, NR> {
    static void run(int, const bf16*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t) {}
};

template <int MR, int NR>
void gemm_cols(int64_t M, const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) ukernel<MR, NR>(A + i * lda, lda, Bp, ldb, Kp, C + i * ldc, ldc);
    if (i < M) Rows<MR, NR>::run(int(M - i), A + i * lda, lda, Bp, ldb, Kp, C + i * ldc, ldc);
}

// C (M x Npad fp32, ldc) = A (M x 2*Kp bf16, lda) * Bp (Kp x Npad x 2 packed); Npad % 16 == 0.
void gemm(int64_t M, int64_t Npad, int64_t Kp, const bf16* A, int64_t lda, const bf16* Bp, float* C, int64_t ldc) {
    const int64_t nv = Npad / 16;
    int64_t j = 0;
    for (; j + 4 <= nv; j += 4) gemm_cols<6, 4>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc);
    switch (nv - j) {
        case 3: gemm_cols<8, 3>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc); break;
        case 2: gemm_cols<12, 2>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc); break;
        case 1: gemm_cols<16, 1>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc); break;
        default: break;
    }
}

// Pack B (K x N, element (k, n) at B[k*rs_k + n*rs_n]) as [Kp][Npad][2], zeros beyond K and N.
void pack_b(const bf16* B, int64_t rs_k, int64_t rs_n, int64_t K, int64_t N, int64_t Kp, int64_t Npad, bf16* out) {
    for (int64_t kp = 0; kp < Kp; ++kp) {
        bf16* dst = out + kp * Npad * 2;
        const int64_t k0 = 2 * kp, k1 = 2 * kp + 1;
        for (int64_t n = 0; n < Npad; ++n) {
            const bool in_n = n < N;
            dst[2 * n] = (in_n && k0 < K) ? B[k0 * rs_k + n * rs_n] : bf16(0);
            dst[2 * n + 1] = (in_n && k1 < K) ? B[k1 * rs_k + n * rs_n] : bf16(0);
        }
    }
}

// Two fp32 rows (16 values each) -> 32 bf16 interleaved a0 b0 a1 b1 ... (one packed-B row).
inline void store_pair(bf16* dst, __m512 a, __m512 b) {
    __m512i ai = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(a));
    __m512i bi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(b));
    _mm512_storeu_si512((void*)dst, _mm512_or_si512(ai, _mm512_slli_epi32(bi, 16)));
}

inline void store_bf16(bf16* dst, __m512 a) { _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(a)); }

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

struct Shape {
    int64_t H, L, S, D, Lpad, Spad, Dpad;
    Shape(int64_t H_, int64_t L_, int64_t S_, int64_t D_)
        : H(H_), L(L_), S(S_), D(D_), Lpad(round_up(L_, 16)), Spad(round_up(S_, 16)), Dpad(round_up(D_, 16)) {}
};

struct Scratch {
    std::vector<bf16> pack;      // packed B operand
    std::vector<float> s;        // L x Spad scores, then probabilities (fp32)
    std::vector<float> dp;       // L x Spad dP
    std::vector<float> out;      // max(L, D, S) x max(Dpad, Spad) fp32 GEMM results
    std::vector<bf16> p;         // L x Spad probabilities (bf16, row-major)
    std::vector<bf16> p_pairs;   // Lpad/2 x Spad x 2: P packed as a B operand over rows
    std::vector<bf16> ds;        // L x Spad dS (bf16, row-major)
    std::vector<bf16> ds_pairs;  // Lpad/2 x Spad x 2
    std::vector<bf16> qt, dot;   // D x Lpad: Q^T, dO^T (row-major, zero padded)
    std::vector<float> bias, keep, drow;
    void fit(const Shape& z) {
        const int64_t big = std::max({z.D * z.Spad, z.Spad * z.Dpad, z.Lpad * z.Dpad});
        if ((int64_t)pack.size() < big) pack.resize(big);
        const int64_t ls = z.Lpad * z.Spad;
        if ((int64_t)s.size() < ls) { s.resize(ls); dp.resize(ls); p.resize(ls); p_pairs.resize(ls); ds.resize(ls); ds_pairs.resize(ls); }
        const int64_t o = std::max({z.Lpad, z.Spad, z.Dpad}) * std::max(z.Dpad, z.Spad);
        if ((int64_t)out.size() < o) out.resize(o);
        if ((int64_t)qt.size() < z.Dpad * z.Lpad) { qt.resize(z.Dpad * z.Lpad); dot.resize(z.Dpad * z.Lpad); }
        if ((int64_t)bias.size() < z.Spad) { bias.resize(z.Spad); keep.resize(z.Spad); }
        if ((int64_t)drow.size() < z.Lpad) drow.resize(z.Lpad);
    }
};

thread_local Scratch scratch;

// bias (0 / -1e30) and keep (1 / 0) per key column, padding columns hidden; returns #visible.
int64_t key_masks(const Shape& z, const uint8_t* mask_row, float* bias, float* keep) {
    int64_t visible = 0;
    for (int64_t j = 0; j < z.Spad; ++j) {
        const bool vis = j < z.S && (mask_row == nullptr || mask_row[j]);
        bias[j] = vis ? 0.0f : -1e30f;
        keep[j] = vis ? 1.0f : 0.0f;
        visible += vis;
    }
    return visible;
}

// s (L x Spad) <- scale * Q K^T, Q (L x D) row-major.
void scores(const Shape& z, const bf16* Q, const bf16* K, Scratch& w) {
    pack_b(K, 1, z.D, z.D, z.S, z.D / 2, z.Spad, w.pack.data());
    gemm(z.L, z.Spad, z.D / 2, Q, z.D, w.pack.data(), w.s.data(), z.Spad);
}

}  // namespace

extern "C" {

int tabfm_attn_bf16_supported() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

void tabfm_attn_bf16_fwd(const bf16* q, const bf16* k, const bf16* v, const uint8_t* mask, bf16* o, float* lse,
                         int64_t begin, int64_t end, int64_t H, int64_t L, int64_t S, int64_t D, float scale) {
    const Shape z(H, L, S, D);
    Scratch& w = scratch;
    w.fit(z);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t sl = begin; sl < end; ++sl) {
        const int64_t n = sl / H;
        const bf16 *Q = q + sl * L * D, *K = k + sl * S * D, *V = v + sl * S * D;
        const int64_t visible = key_masks(z, mask ? mask + n * S : nullptr, w.bias.data(), w.keep.data());
        scores(z, Q, K, w);
        for (int64_t i = 0; i < L; ++i) {
            float* srow = w.s.data() + i * z.Spad;
            bf16* prow = w.p.data() + i * z.Spad;
            if (visible == 0) {
                std::fill(prow, prow + z.Spad, bf16(0));
                lse[sl * L + i] = INFINITY;
                continue;
            }
            __m512 m = _mm512_set1_ps(-1e30f);
            for (int64_t j = 0; j < z.Spad; j += 16) {
                __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vscale, _mm512_loadu_ps(w.bias.data() + j));
                _mm512_storeu_ps(srow + j, x);
                m = _mm512_max_ps(m, x);
            }
            const float mx = _mm512_reduce_max_ps(m);
            __m512 sum = _mm512_setzero_ps();
            const __m512 vm = _mm512_set1_ps(mx);
            for (int64_t j = 0; j < z.Spad; j += 16) {
                __m512 e = _mm512_mul_ps(exp512(_mm512_sub_ps(_mm512_loadu_ps(srow + j), vm)), _mm512_loadu_ps(w.keep.data() + j));
                _mm512_storeu_ps(srow + j, e);
                sum = _mm512_add_ps(sum, e);
            }
            const float l = _mm512_reduce_add_ps(sum);
            const __m512 inv = _mm512_set1_ps(1.0f / l);
            for (int64_t j = 0; j < z.Spad; j += 16) store_bf16(prow + j, _mm512_mul_ps(_mm512_loadu_ps(srow + j), inv));
            lse[sl * L + i] = mx + std::log(l);
        }
        // O = P V
        pack_b(V, z.D, 1, z.S, z.D, z.Spad / 2, z.Dpad, w.pack.data());
        gemm(z.L, z.Dpad, z.Spad / 2, w.p.data(), z.Spad, w.pack.data(), w.out.data(), z.Dpad);
        bf16* O = o + sl * L * D;
        for (int64_t i = 0; i < L; ++i)
            for (int64_t d = 0; d < D; ++d) O[i * D + d] = float_to_bf16(w.out[i * z.Dpad + d]);
    }
}

void tabfm_attn_bf16_bwd(const bf16* q, const bf16* k, const bf16* v, const uint8_t* mask, const float* lse,
                         const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                         int64_t begin, int64_t end, int64_t H, int64_t L, int64_t S, int64_t D, float scale) {
    const Shape z(H, L, S, D);
    Scratch& w = scratch;
    w.fit(z);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 zero = _mm512_setzero_ps();
    for (int64_t sl = begin; sl < end; ++sl) {
        const int64_t n = sl / H;
        const bf16 *Q = q + sl * L * D, *K = k + sl * S * D, *V = v + sl * S * D;
        const bf16* dO = dout + sl * L * D;
        const float* LSE = lse + sl * L;
        key_masks(z, mask ? mask + n * S : nullptr, w.bias.data(), w.keep.data());
        // P = exp(scale * Q K^T + bias - lse) * keep   (fp32 in s)
        scores(z, Q, K, w);
        for (int64_t i = 0; i < L; ++i) {
            float* srow = w.s.data() + i * z.Spad;
            const __m512 vl = _mm512_set1_ps(std::isinf(LSE[i]) ? 1e30f : LSE[i]);
            for (int64_t j = 0; j < z.Spad; j += 16) {
                __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vscale, _mm512_loadu_ps(w.bias.data() + j));
                _mm512_storeu_ps(srow + j, _mm512_mul_ps(exp512(_mm512_sub_ps(x, vl)), _mm512_loadu_ps(w.keep.data() + j)));
            }
        }
        // dP = dO V^T
        pack_b(V, 1, z.D, z.D, z.S, z.D / 2, z.Spad, w.pack.data());
        gemm(z.L, z.Spad, z.D / 2, dO, z.D, w.pack.data(), w.dp.data(), z.Spad);
        // Drow_i = sum_j P_ij dP_ij (= dO_i . O_i in exact arithmetic; from the same fp32 P,
        // so each row of dS sums to zero up to rounding, as the softmax gradient must)
        for (int64_t i = 0; i < L; ++i) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t j = 0; j < z.Spad; j += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(w.s.data() + i * z.Spad + j), _mm512_loadu_ps(w.dp.data() + i * z.Spad + j), acc);
            w.drow[i] = _mm512_reduce_add_ps(acc);
        }
        // dS = scale * P * (dP - Drow): row-major (for dQ) and row-paired (for dK^T); P row-paired (for dV^T)
        for (int64_t i = 0; i < z.Lpad; i += 2) {
            const bool has0 = i < L, has1 = i + 1 < L;
            bf16* pp = w.p_pairs.data() + (i / 2) * z.Spad * 2;
            bf16* dsp = w.ds_pairs.data() + (i / 2) * z.Spad * 2;
            const __m512 d0 = _mm512_set1_ps(has0 ? w.drow[i] : 0.0f), d1 = _mm512_set1_ps(has1 ? w.drow[i + 1] : 0.0f);
            for (int64_t j = 0; j < z.Spad; j += 16) {
                __m512 p0 = zero, p1 = zero, s0 = zero, s1 = zero;
                if (has0) {
                    p0 = _mm512_loadu_ps(w.s.data() + i * z.Spad + j);
                    s0 = _mm512_mul_ps(_mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(w.dp.data() + i * z.Spad + j), d0)), vscale);
                    store_bf16(w.ds.data() + i * z.Spad + j, s0);
                }
                if (has1) {
                    p1 = _mm512_loadu_ps(w.s.data() + (i + 1) * z.Spad + j);
                    s1 = _mm512_mul_ps(_mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(w.dp.data() + (i + 1) * z.Spad + j), d1)), vscale);
                    store_bf16(w.ds.data() + (i + 1) * z.Spad + j, s1);
                }
                store_pair(pp + 2 * j, p0, p1);
                store_pair(dsp + 2 * j, s0, s1);
            }
        }
        // Q^T and dO^T (D x Lpad, zero padded) as A operands of dK^T and dV^T
        for (int64_t d = 0; d < D; ++d) {
            for (int64_t i = 0; i < z.Lpad; ++i) {
                w.qt[d * z.Lpad + i] = i < L ? Q[i * D + d] : bf16(0);
                w.dot[d * z.Lpad + i] = i < L ? dO[i * D + d] : bf16(0);
            }
        }
        // dV^T = dO^T P  (D x Spad), dK^T = Q^T dS  (D x Spad)
        gemm(z.D, z.Spad, z.Lpad / 2, w.dot.data(), z.Lpad, w.p_pairs.data(), w.out.data(), z.Spad);
        bf16* dV = dv + sl * S * D;
        for (int64_t j = 0; j < S; ++j)
            for (int64_t d = 0; d < D; ++d) dV[j * D + d] = float_to_bf16(w.out[d * z.Spad + j]);
        gemm(z.D, z.Spad, z.Lpad / 2, w.qt.data(), z.Lpad, w.ds_pairs.data(), w.out.data(), z.Spad);
        bf16* dK = dk + sl * S * D;
        for (int64_t j = 0; j < S; ++j)
            for (int64_t d = 0; d < D; ++d) dK[j * D + d] = float_to_bf16(w.out[d * z.Spad + j]);
        // dQ = dS K  (L x Dpad); dS padding columns are zero, so K's rows beyond S are packed as zeros
        pack_b(K, z.D, 1, z.S, z.D, z.Spad / 2, z.Dpad, w.pack.data());
        gemm(z.L, z.Dpad, z.Spad / 2, w.ds.data(), z.Spad, w.pack.data(), w.out.data(), z.Dpad);
        bf16* dQ = dq + sl * L * D;
        for (int64_t i = 0; i < L; ++i)
            for (int64_t d = 0; d < D; ++d) dQ[i * D + d] = float_to_bf16(w.out[i * z.Dpad + d]);
    }
}

}  // extern "C"
