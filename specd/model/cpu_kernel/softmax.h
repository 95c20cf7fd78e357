// The attention's softmax, each score row in place: its max, exp(score - max) (exp_nonpos:
// Cephes' polynomial, 8 lanes; exp_nonpos16 the same on 16), then 1 / the sum in key order
// (softmax_rows). ISA: AVX2 + FMA; exp_nonpos16 / exps_512 AVX512F through X512 (att_avx512).
// Relies on common.h. The fused layer's SiLU (layer.h) uses exp_nonpos too.
#pragma once

#include "common.h"

// exp of x <= 0 (a score minus its row's max), 8 lanes, Cephes' expf polynomial (about 1 ulp);
// below -87.3 (and -inf, a masked key) exactly 0. Every key goes through this one function, so a
// key's weight never depends on where it falls in a vector.
// its constants, shared with the 16-lane version (exp_nonpos16) so the two cannot drift apart
static constexpr float EXP_LO = -87.3f, EXP_LOG2E = 1.44269504088896341f, EXP_LN2_HI = 0.693359375f,
                       EXP_LN2_LO = -2.12194440e-4f;
static constexpr float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                   4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
static inline __m256 exp_nonpos(__m256 x) {
    const __m256 lo = _mm256_set1_ps(EXP_LO);
    const __m256 xc = _mm256_max_ps(x, lo);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 y = _mm256_set1_ps(EXP_P[0]);
    for (int k = 1; k < 6; k++) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(EXP_P[k]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
}

// exp_nonpos on 16 lanes (AVX512: the same operations lane by lane, so the same bits)
X512 static inline __m512 exp_nonpos16(__m512 x) {
    const __m512 lo = _mm512_set1_ps(EXP_LO);
    const __m512 xc = _mm512_max_ps(x, lo);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 y = _mm512_set1_ps(EXP_P[0]);
    for (int k = 1; k < 6; k++) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(EXP_P[k]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    const __m512 v = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), v, _mm512_setzero_ps());
}

// si[j] = exp_nonpos(si[j] - m) 16 lanes at a time for j in 0 .. 16 * (L8 / 16) - 1; returns where
// it stopped (the caller takes the rest 8 lanes at a time)
X512 static int64_t exps_512(float* si, int64_t L8, float m) {
    const __m512 m16 = _mm512_set1_ps(m);
    int64_t j = 0;
    for (; j + 16 <= L8; j += 16) _mm512_storeu_ps(si + j, exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(si + j), m16)));
    return j;
}

// Each of n rows' softmax in place over its L keys (rows L8 apart; keys L .. L8-1 hold -inf), 1 / its
// sum into inv: the max (exact: row_max), the exps (exp_nonpos), then the sum in key order, each row
// its own scalar chain (up to SUM_ROWS rows' chains interleaved: one chain waits an add's latency per
// key): a row's bits never depend on which rows share the call, and a tree node's sum equals the same
// token's decoded one by one.
#define SUM_ROWS 8
template <int NR>
static void row_sums(const float* S, int64_t L8, int64_t L, float* l) {
    float a[NR];
    for (int i = 0; i < NR; i++) a[i] = 0.f;
    for (int64_t j = 0; j < L; j++)
        for (int i = 0; i < NR; i++) a[i] += S[i * L8 + j];
    for (int i = 0; i < NR; i++) l[i] = a[i];
}

// The largest of si[0 .. L8-1] (L8 a multiple of 8): four independent max chains (a max waits on
// the last one's latency), any order giving the same value (max is exact; -0 or +0 for a zero max
// makes no difference to the exps)
static inline float row_max(const float* si, int64_t L8) {
    __m256 m[4];
    for (int k = 0; k < 4; k++) m[k] = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 32 <= L8; j += 32)
        for (int k = 0; k < 4; k++) m[k] = _mm256_max_ps(m[k], _mm256_loadu_ps(si + j + 8 * k));
    for (; j < L8; j += 8) m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(si + j));
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
    float mx = -INFINITY;
    for (int k = 0; k < 8; k++) mx = t[k] > mx ? t[k] : mx;
    return mx;
}

static void softmax_rows(float* S, int64_t n, int64_t L, float* inv) {
    const int64_t L8 = (L + 7) / 8 * 8;
    for (int64_t i = 0; i < n; i++) {
        float* si = S + i * L8;
        const float mx = row_max(si, L8);
        const float m0 = mx == -INFINITY ? 0.f : mx;
        int64_t j = att_avx512() ? exps_512(si, L8, m0) : 0;
        const __m256 m8 = _mm256_set1_ps(m0);
        for (; j < L8; j += 8) _mm256_storeu_ps(si + j, exp_nonpos(_mm256_sub_ps(_mm256_loadu_ps(si + j), m8)));
    }
    for (int64_t i = 0; i < n; i += SUM_ROWS) {
        float l[SUM_ROWS];
#define SUM_CASE(k) \
    case k: row_sums<k>(S + i * L8, L8, L, l); break;
        switch (n - i < SUM_ROWS ? n - i : SUM_ROWS) {
            SUM_CASE(8) SUM_CASE(7) SUM_CASE(6) SUM_CASE(5) SUM_CASE(4) SUM_CASE(3) SUM_CASE(2)
            default: row_sums<1>(S + i * L8, L8, L, l);
        }
#undef SUM_CASE
        for (int64_t k = 0; k < SUM_ROWS && i + k < n; k++) inv[i + k] = l[k] > 0.f ? 1.f / l[k] : 0.f;
    }
}
