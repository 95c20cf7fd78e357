// The attention's weighted sums: out = (sum over keys of p_j * v_j) * 1 / sum, per 32-column
// slice of the values and group of rows, each output element its own fma chain over the keys in
// order (wsum32 on AVX2, wsum32_512 on AVX512, weighted_sums picks and falls back to scalar fmaf
// chains for head sizes that are not a multiple of 32). ISA: AVX2 + FMA; the *_512 functions
// AVX512F through X512 (att_avx512). Relies on common.h (ld8, ld16, ld1, KV_PREFETCH); the weights
// come from softmax.h.
#pragma once

#include "common.h"

// A value row's 32-column slice at p, fetched ahead: 128 bytes in fp32, 64 in fp16
template <class T>
static inline void prefetch_slice(const T* p) {
    _mm_prefetch((const char*)p, _MM_HINT_T0);
    if (sizeof(T) == 4) _mm_prefetch((const char*)p + 64, _MM_HINT_T0);
}

// Weighted sums of NR rows over one 32-column slice c0 .. c0+31 of the values: out_i[c] = (sum_j
// p_i[j] * v_j[c], one fmaf per key in key order) * inv_i; a key whose weight is 0 is skipped for
// that row (its value is never read for it). Every output element is its own fma chain over the keys
// in order, so which rows or columns share a pass (or an instruction set) changes no bit; the rows
// share each value row's load. p: the rows' weights, NR rows L8 apart; out: the rows' outputs.
#define WS_COLS 32
#define WS_MAX_ROWS 3  // AVX2: 3 rows x 4 accumulators + a broadcast fit the 16 ymm registers
template <int NR, class VRow>
static void wsum32(const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                   float* const* out) {
    __m256 acc[NR][4];
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < 4; t++) acc[i][t] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; j++) {
        if (j + KV_PREFETCH < L) prefetch_slice(vrow(j + KV_PREFETCH) + c0);
        const auto* vj = vrow(j) + c0;
        for (int i = 0; i < NR; i++) {
            const float w = p[i * L8 + j];
            if (w == 0.f) continue;
            const __m256 wv = _mm256_set1_ps(w);
            for (int t = 0; t < 4; t++) acc[i][t] = _mm256_fmadd_ps(wv, ld8(vj + 8 * t), acc[i][t]);
        }
    }
    for (int i = 0; i < NR; i++)
        for (int t = 0; t < 4; t++) _mm256_storeu_ps(out[i] + c0 + 8 * t, _mm256_mul_ps(acc[i][t], _mm256_set1_ps(inv[i])));
}

// wsum32 (the same bits) on AVX512: up to 8 rows x 2 accumulators in registers. Keys go 16 at a
// time: where none of the block's weights is 0 in any row (a decode row's keys, nearly always), the
// block runs without the per-key zero tests (each weight broadcast straight into its fma); a block
// with a zero weight, and the last keys, take them key by key. Either way every accumulator gets the
// same fmas in the same key order, so the same bits.
#define WS_MAX_ROWS_512 8
// key j's value slice into NR rows' accumulators; ZEROS: skip a row whose weight is 0 (its value is
// then never read for it), else every weight is known non-zero
template <int NR, bool ZEROS, class VRow>
X512 static inline void wsum_key_512(const float* p, int64_t L8, int64_t L, int64_t j, VRow vrow, int64_t c0,
                                     __m512 (*acc)[2]) {
    if (j + KV_PREFETCH < L) prefetch_slice(vrow(j + KV_PREFETCH) + c0);
    const auto* vj = vrow(j) + c0;
    const __m512 v0 = ld16(vj), v1 = ld16(vj + 16);
    for (int i = 0; i < NR; i++) {
        const float w = p[i * L8 + j];
        if (ZEROS && w == 0.f) continue;
        const __m512 wv = _mm512_set1_ps(w);
        acc[i][0] = _mm512_fmadd_ps(wv, v0, acc[i][0]), acc[i][1] = _mm512_fmadd_ps(wv, v1, acc[i][1]);
    }
}

template <int NR, class VRow>
X512 static void wsum32_512(const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                            float* const* out) {
    __m512 acc[NR][2];
    for (int i = 0; i < NR; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    const __m512 zero = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= L; j += 16) {
        __mmask16 z = 0;
        for (int i = 0; i < NR; i++) z |= _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i * L8 + j), zero, _CMP_EQ_OQ);
        if (z)
            for (int64_t t = j; t < j + 16; t++) wsum_key_512<NR, true>(p, L8, L, t, vrow, c0, acc);
        else
            for (int64_t t = j; t < j + 16; t++) wsum_key_512<NR, false>(p, L8, L, t, vrow, c0, acc);
    }
    for (; j < L; j++) wsum_key_512<NR, true>(p, L8, L, j, vrow, c0, acc);
    for (int i = 0; i < NR; i++) {
        const __m512 s = _mm512_set1_ps(inv[i]);
        _mm512_storeu_ps(out[i] + c0, _mm512_mul_ps(acc[i][0], s));
        _mm512_storeu_ps(out[i] + c0 + 16, _mm512_mul_ps(acc[i][1], s));
    }
}

// The most rows one weighted-sum pass takes on this machine's instruction set
static int64_t ws_max_rows() { return att_avx512() ? WS_MAX_ROWS_512 : WS_MAX_ROWS; }

// n (1 .. ws_max_rows()) rows' weighted sums over columns c0 .. c0+31 (wsum32 / wsum32_512)
template <class VRow>
static void wsum_rows(int64_t n, const float* p, int64_t L8, int64_t L, VRow vrow, int64_t c0, const float* inv,
                      float* const* out) {
#define WS_CASE(k) \
    case k: (att_avx512() ? wsum32_512<k, VRow> : wsum32<k, VRow>)(p, L8, L, vrow, c0, inv, out); return;
    switch (n) {
        WS_CASE(1) WS_CASE(2) WS_CASE(3)
    }
#undef WS_CASE
#define WS_CASE(k) \
    case k: wsum32_512<k, VRow>(p, L8, L, vrow, c0, inv, out); return;
    switch (n) {
        WS_CASE(4) WS_CASE(5) WS_CASE(6) WS_CASE(7) WS_CASE(8)
    }
#undef WS_CASE
}

// Rows 0 .. n-1's weighted sums (their weights in S, L8 apart, 1 / sums in inv) into out[0 .. n-1]:
// per 32-column slice, rows in passes of at most ws_max_rows(); a head size that is not a multiple of
// 32 one row and column at a time (the same fmaf chains).
template <class VRow>
static void weighted_sums(int64_t n, const float* S, int64_t L, VRow vrow, int64_t D, const float* inv,
                          float* const* out) {
    const int64_t L8 = (L + 7) / 8 * 8, mr = ws_max_rows();
    if (D % WS_COLS == 0) {
        for (int64_t c0 = 0; c0 < D; c0 += WS_COLS)
            for (int64_t i = 0; i < n; i += mr)
                wsum_rows(n - i < mr ? n - i : mr, S + i * L8, L8, L, vrow, c0, inv + i, out + i);
        return;
    }
    for (int64_t i = 0; i < n; i++) {
        const float* si = S + i * L8;
        float* o = out[i];
        for (int64_t d = 0; d < D; d++) o[d] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            const float w = si[j];
            if (w == 0.f) continue;  // masked or negligible: never read its value (padding may hold anything)
            const auto* vj = vrow(j);
            for (int64_t d = 0; d < D; d++) o[d] = fmaf(w, ld1(vj + d), o[d]);
        }
        for (int64_t d = 0; d < D; d++) o[d] *= inv[i];
    }
}
