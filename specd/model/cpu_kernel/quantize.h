// The activations' side of the GEMMs, row by row: the fp32 sums of x per group of G (the int4
// weights' min term: group_sums, for both GEMM families), and x quantized to int8 for the
// int8-activation GEMMs (quantize_q8: blocks of 32, d = max|x| / 127, q = round(x / d), GGUF Q8_0 /
// llama.cpp's activation format; see gemm_x8_avx2.h's top). ISA: AVX2. Relies on common.h (hsum8,
// for_rows).
#pragma once

#include "common.h"

// int8 activations (see gemm_x8_avx2.h's top): qx int8 [M, K], dx fp32 [M, K/32]
static void quantize_q8(const float* x, int64_t M, int64_t K, int8_t* qx, float* dx) {
    const int64_t nb = K / 32;
    const __m256 signbit = _mm256_set1_ps(-0.0f);
#pragma omp parallel for schedule(static) if (M * K > 65536)
    for (int64_t i = 0; i < M * nb; i++) {
        const float* xb = x + i * 32;
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int t = 0; t < 4; t++) {
            v[t] = _mm256_loadu_ps(xb + 8 * t);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(signbit, v[t]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const float d = amax / 127.0f;
        dx[i] = d;
        const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
        __m256i q[4];
        for (int t = 0; t < 4; t++)
            q[t] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[t], inv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // pack 32 int32 -> 32 int8 in order (packs work per 128-bit lane: fix the order after)
        __m256i a = _mm256_packs_epi32(q[0], q[1]), b = _mm256_packs_epi32(q[2], q[3]);
        __m256i c = _mm256_packs_epi16(a, b);
        c = _mm256_permutevar8x32_epi32(c, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(qx + i * 32), c);
    }
}

static void group_sums(const float* x, int64_t M, int64_t K, int64_t G, float* xsum) {
    const int64_t ng = K / G;
    for_rows(M, [&](int64_t m) {
        for (int64_t g = 0; g < ng; g++) {
            __m256 s = _mm256_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + m * K + k));
            xsum[m * ng + g] = hsum8(s);
        }
    });
}
