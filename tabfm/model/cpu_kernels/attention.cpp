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

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// ---------------------------------------------------------------- GEMM micro-kernels
// C[MR x 16*NR] (+)= A[MR x 2*Kp] * Bp, Bp already offset to the first column (row stride 2*ldb).
template <int MR, int NR>
inline void ukernel(const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc, bool add) {
    __m512 acc[MR][NR];
    for (int i = 0; i < MR; ++i)
        for (int r = 0; r < NR; ++r) acc[i][r] = add ? _mm512_loadu_ps(C + i * ldc + 16 * r) : _mm512_setzero_ps();
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
    static void run(int m, const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc, bool add) {
        if (m == MR) ukernel<MR, NR>(A, lda, Bp, ldb, Kp, C, ldc, add);
        else Rows<MR - 1, NR>::run(m, A, lda, Bp, ldb, Kp, C, ldc, add);
    }
};
template <int NR>
struct Rows<0, NR> {
    static void run(int, const bf16*, int64_t, const bf16*, int64_t, int64_t, float*, int64_t, bool) {}
};

template <int MR, int NR>
void gemm_cols(int64_t M, const bf16* A, int64_t lda, const bf16* Bp, int64_t ldb, int64_t Kp, float* C, int64_t ldc, bool add) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) ukernel<MR, NR>(A + i * lda, lda, Bp, ldb, Kp, C + i * ldc, ldc, add);
    if (i < M) Rows<MR, NR>::run(int(M - i), A + i * lda, lda, Bp, ldb, Kp, C + i * ldc, ldc, add);
}

// C (M x Npad fp32, ldc) (+)= A (M x 2*Kp bf16, lda) * Bp (Kp x Npad x 2 packed); Npad % 16 == 0.
void gemm(int64_t M, int64_t Npad, int64_t Kp, const bf16* A, int64_t lda, const bf16* Bp, float* C, int64_t ldc,
          bool add = false) {
    const int64_t nv = Npad / 16;
    int64_t j = 0;
    for (; j + 4 <= nv; j += 4) gemm_cols<6, 4>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc, add);
    switch (nv - j) {
        case 3: gemm_cols<8, 3>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc, add); break;
        case 2: gemm_cols<12, 2>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc, add); break;
        case 1: gemm_cols<16, 1>(M, A, lda, Bp + 32 * j, Npad, Kp, C + 16 * j, ldc, add); break;
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

// dst[i*D + d] = bf16(src[i*lds + d] * row_scale[i]) for i < M, d < D (row_scale null = 1).
void rows_out(const float* src, int64_t lds, int64_t M, int64_t D, const float* row_scale, bf16* dst) {
    for (int64_t i = 0; i < M; ++i) {
        const __m512 f = _mm512_set1_ps(row_scale ? row_scale[i] : 1.0f);
        for (int64_t d = 0; d < D; d += 16) {
            const __mmask16 m = d + 16 <= D ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
            __m256i b = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + i * lds + d), f));
            _mm256_mask_storeu_epi16(dst + i * D + d, m, b);
        }
    }
}

// dst[j*D + d] = bf16(src[d*lds + j]) for j < S, d < D: a transposed GEMM result back to rows.
void cols_out(const float* src, int64_t lds, int64_t S, int64_t D, bf16* dst) {
    alignas(64) int32_t idx[16];
    for (int t = 0; t < 16; ++t) idx[t] = int32_t(t * lds);
    const __m512i vidx = _mm512_load_si512(idx);
    for (int64_t d = 0; d < D; d += 16) {
        const __mmask16 m = d + 16 <= D ? __mmask16(0xFFFF) : __mmask16((1u << (D - d)) - 1);
        for (int64_t j = 0; j < S; ++j) {
            __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, vidx, src + d * lds + j, 4);
            _mm256_mask_storeu_epi16(dst + j * D + d, m, (__m256i)_mm512_cvtneps_pbh(x));
        }
    }
}

constexpr int64_t BR = 64;  // query rows per block: a block's scores and dP stay in L1/L2

struct Scratch {
    std::vector<bf16> kt, vt, kn, vn;  // packed B operands: K^T, V^T (D/2 x Spad x 2); K, V (Spad/2 x Dpad x 2)
    std::vector<float> s, dp;          // BR x Spad: scores, then probabilities (fp32); dP
    std::vector<bf16> p, ds;           // BR x Spad bf16 row-major: P (forward), dS (backward)
    std::vector<bf16> p_pairs, ds_pairs;  // BR/2 x Spad x 2: P, dS packed as B operands over rows
    std::vector<bf16> qt, dot;         // D x BR: Q^T, dO^T of a block (A operands)
    std::vector<float> dvt, dkt;       // D x Spad: dV^T, dK^T accumulated over blocks
    std::vector<float> out;            // BR x Dpad: O or dQ of a block
    std::vector<float> bias, keep, drow;
    template <class T>
    static T* fit(std::vector<T>& v, int64_t n) {
        if ((int64_t)v.size() < n) v.resize(n);
        return v.data();
    }
};

thread_local Scratch scratch;

// bias (0 / -1e30) and keep (1 / 0) per key column, padding columns hidden; returns #visible.
int64_t key_masks(int64_t S, int64_t Spad, const uint8_t* mask_row, float* bias, float* keep) {
    int64_t visible = 0;
    for (int64_t j = 0; j < Spad; ++j) {
        const bool vis = j < S && (mask_row == nullptr || mask_row[j]);
        bias[j] = vis ? 0.0f : -1e30f;
        keep[j] = vis ? 1.0f : 0.0f;
        visible += vis;
    }
    return visible;
}

}  // namespace

extern "C" {

void tabfm_attn_bf16_fwd(const bf16* q, const bf16* k, const bf16* v, const uint8_t* mask, bf16* o, float* lse,
                         int64_t begin, int64_t end, int64_t H, int64_t L, int64_t S, int64_t D, float scale) {
    const int64_t Spad = round_up(S, 16), Dpad = round_up(D, 16);
    Scratch& w = scratch;
    bf16* kt = Scratch::fit(w.kt, D * Spad);
    bf16* vn = Scratch::fit(w.vn, Spad * Dpad);
    float* sb = Scratch::fit(w.s, BR * Spad);
    bf16* pb = Scratch::fit(w.p, BR * Spad);
    float* out = Scratch::fit(w.out, BR * Dpad);
    float* bias = Scratch::fit(w.bias, Spad);
    float* keep = Scratch::fit(w.keep, Spad);
    float* inv_l = Scratch::fit(w.drow, BR);
    const __m512 vscale = _mm512_set1_ps(scale);
    int64_t masked_seq = -1, visible = 0;  // the heads of one sequence share its key mask
    for (int64_t sl = begin; sl < end; ++sl) {
        const bf16 *Q = q + sl * L * D, *K = k + sl * S * D, *V = v + sl * S * D;
        const int64_t seq = mask ? sl / H : 0;
        if (seq != masked_seq) {
            visible = key_masks(S, Spad, mask ? mask + seq * S : nullptr, bias, keep);
            masked_seq = seq;
        }
        pack_b(K, 1, D, D, S, D / 2, Spad, kt);     // B[d][j] = K[j][d]
        pack_b(V, D, 1, S, D, Spad / 2, Dpad, vn);  // B[j][d] = V[j][d]
        for (int64_t r0 = 0; r0 < L; r0 += BR) {
            const int64_t rb = std::min(BR, L - r0);
            gemm(rb, Spad, D / 2, Q + r0 * D, D, kt, sb, Spad);
            for (int64_t i = 0; i < rb; ++i) {
                const float* srow = sb + i * Spad;
                bf16* prow = pb + i * Spad;
                if (visible == 0) {
                    std::fill(prow, prow + Spad, bf16(0));
                    inv_l[i] = 0.0f;
                    lse[sl * L + r0 + i] = INFINITY;
                    continue;
                }
                __m512 m = _mm512_set1_ps(-1e30f);
                for (int64_t j = 0; j < Spad; j += 16)
                    m = _mm512_max_ps(m, _mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vscale, _mm512_loadu_ps(bias + j)));
                const float mx = _mm512_reduce_max_ps(m);
                const __m512 vm = _mm512_set1_ps(-mx);
                __m512 sum = _mm512_setzero_ps();
                for (int64_t j = 0; j < Spad; j += 16) {  // unnormalised probabilities (<= 1); 1/l scales O
                    __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vscale, _mm512_add_ps(_mm512_loadu_ps(bias + j), vm));
                    __m512 e = _mm512_mul_ps(exp512(x), _mm512_loadu_ps(keep + j));
                    store_bf16(prow + j, e);
                    sum = _mm512_add_ps(sum, e);
                }
                const float l = _mm512_reduce_add_ps(sum);
                inv_l[i] = 1.0f / l;
                lse[sl * L + r0 + i] = mx + std::log(l);
            }
            gemm(rb, Dpad, Spad / 2, pb, Spad, vn, out, Dpad);  // O = (P V) / l
            rows_out(out, Dpad, rb, D, inv_l, o + sl * L * D + r0 * D);
        }
    }
}

void tabfm_attn_bf16_bwd(const bf16* q, const bf16* k, const bf16* v, const uint8_t* mask, const float* lse,
                         const bf16* dout, bf16* dq, bf16* dk, bf16* dv,
                         int64_t begin, int64_t end, int64_t H, int64_t L, int64_t S, int64_t D, float scale) {
    const int64_t Spad = round_up(S, 16), Dpad = round_up(D, 16);
    Scratch& w = scratch;
    bf16* kt = Scratch::fit(w.kt, D * Spad);
    bf16* vt = Scratch::fit(w.vt, D * Spad);
    bf16* kn = Scratch::fit(w.kn, Spad * Dpad);
    float* sb = Scratch::fit(w.s, BR * Spad);
    float* dpb = Scratch::fit(w.dp, BR * Spad);
    bf16* dsb = Scratch::fit(w.ds, BR * Spad);
    bf16* pp = Scratch::fit(w.p_pairs, BR * Spad);
    bf16* dsp = Scratch::fit(w.ds_pairs, BR * Spad);
    bf16* qt = Scratch::fit(w.qt, D * BR);
    bf16* dot = Scratch::fit(w.dot, D * BR);
    float* dvt = Scratch::fit(w.dvt, D * Spad);
    float* dkt = Scratch::fit(w.dkt, D * Spad);
    float* out = Scratch::fit(w.out, BR * Dpad);
    float* bias = Scratch::fit(w.bias, Spad);
    float* keep = Scratch::fit(w.keep, Spad);
    float* drow = Scratch::fit(w.drow, BR);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512 zero = _mm512_setzero_ps();
    int64_t masked_seq = -1;  // the heads of one sequence share its key mask
    for (int64_t sl = begin; sl < end; ++sl) {
        const bf16 *Q = q + sl * L * D, *K = k + sl * S * D, *V = v + sl * S * D, *dO = dout + sl * L * D;
        const float* LSE = lse + sl * L;
        const int64_t seq = mask ? sl / H : 0;
        if (seq != masked_seq) {
            key_masks(S, Spad, mask ? mask + seq * S : nullptr, bias, keep);
            masked_seq = seq;
        }
        pack_b(K, 1, D, D, S, D / 2, Spad, kt);     // B[d][j] = K[j][d]
        pack_b(V, 1, D, D, S, D / 2, Spad, vt);     // B[d][j] = V[j][d]
        pack_b(K, D, 1, S, D, Spad / 2, Dpad, kn);  // B[j][d] = K[j][d]
        for (int64_t r0 = 0; r0 < L; r0 += BR) {
            const int64_t rb = std::min(BR, L - r0), rb2 = round_up(rb, 2);
            const bf16 *Qb = Q + r0 * D, *dOb = dO + r0 * D;
            gemm(rb, Spad, D / 2, dOb, D, vt, dpb, Spad);  // dP = dO V^T
            gemm(rb, Spad, D / 2, Qb, D, kt, sb, Spad);    // Q K^T
            // P = exp(scale * Q K^T + bias - lse) * keep (fp32, in place) and Drow_i = sum_j P_ij dP_ij
            // (= dO_i . O_i in exact arithmetic; from the same fp32 P, so each row of dS sums to
            // zero up to rounding, as the softmax gradient must)
            for (int64_t i = 0; i < rb; ++i) {
                float* srow = sb + i * Spad;
                const float* dprow = dpb + i * Spad;
                const float li = LSE[r0 + i];
                const __m512 vl = _mm512_set1_ps(std::isinf(li) ? -1e30f : -li);
                __m512 acc = _mm512_setzero_ps();
                for (int64_t j = 0; j < Spad; j += 16) {
                    __m512 x = _mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vscale, _mm512_add_ps(_mm512_loadu_ps(bias + j), vl));
                    __m512 pj = _mm512_mul_ps(exp512(x), _mm512_loadu_ps(keep + j));
                    _mm512_storeu_ps(srow + j, pj);
                    acc = _mm512_fmadd_ps(pj, _mm512_loadu_ps(dprow + j), acc);
                }
                drow[i] = _mm512_reduce_add_ps(acc);
            }
            // dS = scale * P * (dP - Drow): row-major (for dQ), row-paired (for dK^T); P row-paired (for dV^T)
            for (int64_t i = 0; i < rb2; i += 2) {
                const bool has1 = i + 1 < rb;
                const __m512 d0 = _mm512_set1_ps(drow[i]), d1 = _mm512_set1_ps(has1 ? drow[i + 1] : 0.0f);
                for (int64_t j = 0; j < Spad; j += 16) {
                    const __m512 p0 = _mm512_loadu_ps(sb + i * Spad + j);
                    const __m512 s0 = _mm512_mul_ps(_mm512_mul_ps(p0, _mm512_sub_ps(_mm512_loadu_ps(dpb + i * Spad + j), d0)), vscale);
                    store_bf16(dsb + i * Spad + j, s0);
                    __m512 p1 = zero, s1 = zero;
                    if (has1) {
                        p1 = _mm512_loadu_ps(sb + (i + 1) * Spad + j);
                        s1 = _mm512_mul_ps(_mm512_mul_ps(p1, _mm512_sub_ps(_mm512_loadu_ps(dpb + (i + 1) * Spad + j), d1)), vscale);
                        store_bf16(dsb + (i + 1) * Spad + j, s1);
                    }
                    store_pair(pp + (i / 2) * Spad * 2 + 2 * j, p0, p1);
                    store_pair(dsp + (i / 2) * Spad * 2 + 2 * j, s0, s1);
                }
            }
            // Q^T and dO^T of the block (D x rb2, zero padded): A operands of dK^T and dV^T
            for (int64_t d = 0; d < D; ++d) {
                for (int64_t i = 0; i < rb2; ++i) {
                    qt[d * rb2 + i] = i < rb ? Qb[i * D + d] : bf16(0);
                    dot[d * rb2 + i] = i < rb ? dOb[i * D + d] : bf16(0);
                }
            }
            gemm(D, Spad, rb2 / 2, dot, rb2, pp, dvt, Spad, r0 > 0);  // dV^T += dO^T P
            gemm(D, Spad, rb2 / 2, qt, rb2, dsp, dkt, Spad, r0 > 0);  // dK^T += Q^T dS
            gemm(rb, Dpad, Spad / 2, dsb, Spad, kn, out, Dpad);       // dQ = dS K
            rows_out(out, Dpad, rb, D, nullptr, dq + sl * L * D + r0 * D);
        }
        cols_out(dvt, Spad, S, D, dv + sl * S * D);
        cols_out(dkt, Spad, S, D, dk + sl * S * D);
    }
}

}  // extern "C"
