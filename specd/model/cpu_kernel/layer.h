// One decoder layer of a quantized Llama-family model (or a feature head's) in one call: RMSNorm
// (rms_rows), the projections (lin: an fp32- or int8-activation GEMM per Lin kind), RoPE (rope_rows),
// the new keys and values into the paged cache then the attention (write_and_attend), SiLU
// (silu_mul_rows): decoder_layer, which specd_head_layer and specd_layers (kernel.cpp) run.
// ISA: AVX2 + FMA + F16C (the GEMMs and the attention choose their own). Relies on common.h,
// gemm_f32.h (gemm), quantize.h (quantize_q8, group_sums), gemm_x8.h (gemm_x8), softmax.h
// (exp_nonpos) and attention.h (paged_attention_2p, paged_attention).
//
// One decoder layer of a quantized Llama-family model in one call (``specd.model.fused``): the ~60
// small torch ops of a layer cost more than its matmuls at decode widths. Every step is row-wise
// (RMSNorm, RoPE, SiLU), row-independent (the quantized matmuls: gemm_f32.h, gemm_x8.h) or the row-at-a-time
// attention (attention.h), so a row's result depends on that row alone, as on the op-by-op path.
#pragma once

#include "attention.h"
#include "common.h"
#include "gemm_f32.h"
#include "gemm_kq.h"
#include "gemm_x8.h"
#include "quantize.h"
#include "softmax.h"

// kind 0 int8 / 1 int4 (fp32 activations); 2 int8 / 3 int4 (x8 layout, int8 activations), fp32 scales
// and mins; 4 / 5: the same with half scales and mins (X8_HALF); 6: GGUF K-quants in the kq layout
// (gemm_kq.h; int8 activations): w the tiles' bytes, scale the tile table (int64 per tile), mins unused;
// 11 / 13: kinds 3 / 5 whose mins are -8 x the scales (X8_OFF8, GGUF Q4_0's), none stored
struct Lin {
    int64_t kind, N, K, G, Kin;  // K: the padded row length (a multiple of 32), Kin <= K: x's row length
    const void* w;
    const void* scale;
    const void* mins;
    const float* bias;
};
#define X8_INT4 1  // kinds 2-5 less 2: bit 0 int4, bit 1 half scales (specd_qgemm_x8's fmt)
#define X8_HALF 2
#define X8_KQ 4  // kind 6
// int4 whose mins are -8 x the block scales (GGUF Q4_0: d * (q - 8)): computed from the scales in the
// registers (exact in fp32: the bits of the stored mins), not read: 144 bytes per 8 x 32 weights, not 160
#define X8_OFF8 8

// the K-quant kinds' projection: x's int8 codes, their scales and their sums per 16
static void lin_kq(const Lin& L, const float* x, int64_t M, const float* add, float* y, std::vector<float>& fs,
                   std::vector<int8_t>& qs) {
    static thread_local std::vector<int32_t> xs16;
    const int64_t K = L.K;
    fs.resize(2 * M * (K / 32)), qs.resize(M * K);
    if ((int64_t)xs16.size() < M * (K / 16)) xs16.resize(M * (K / 16));
    float *dx = fs.data(), *xsf = dx + M * (K / 32);
    quantize_q8(x, M, K, qs.data(), dx);
    code_sums(qs.data(), dx, M, K, xs16.data(), xsf);
    gemm_kq(qs.data(), dx, xs16.data(), xsf, M, K, (const uint8_t*)L.w, (const int64_t*)L.scale, L.N, add, L.bias, y);
}

template <class S>
static void lin_x8(const Lin& L, const int8_t* qs, const float* dx, const float* xs, int64_t M, const float* add,
                   float* y) {
    const S *sc = (const S*)L.scale, *mn = (const S*)L.mins;
    const bool off8 = (L.kind - 2) & X8_OFF8;
    if ((L.kind - 2) & X8_INT4)
        gemm_x8<true, S>(qs, dx, xs, M, L.K, (const uint8_t*)L.w, sc, off8 ? nullptr : mn, off8, L.N, add, L.bias, y);
    else
        gemm_x8<false, S>(qs, dx, xs, M, L.K, (const uint8_t*)L.w, sc, nullptr, false, L.N, add, L.bias, y);
}

// y = x @ W^T (+ bias) (+ add); add may alias y
static void lin(const Lin& L, const float* x, int64_t M, const float* add, float* y, std::vector<float>& fs,
                std::vector<int8_t>& qs, std::vector<float>& xp) {
    const int64_t K = L.K, nbk = K / 32;
    if (L.Kin != K) {  // zero-pad the rows to K
        xp.assign(M * K, 0.f);
        for (int64_t m = 0; m < M; m++) memcpy(xp.data() + m * K, x + m * L.Kin, L.Kin * sizeof(float));
        x = xp.data();
    }
    if (L.kind == 2 + X8_KQ) {
        lin_kq(L, x, M, add, y, fs, qs);
    } else if (L.kind >= 2) {
        fs.resize(2 * M * nbk);
        qs.resize(M * K);
        float *xs = fs.data(), *dx = xs + M * nbk;
        if (((L.kind - 2) & X8_INT4) && (L.mins || ((L.kind - 2) & X8_OFF8))) group_sums(x, M, K, 32, xs);
        quantize_q8(x, M, K, qs.data(), dx);
        if ((L.kind - 2) & X8_HALF)
            lin_x8<half_t>(L, qs.data(), dx, xs, M, add, y);
        else
            lin_x8<float>(L, qs.data(), dx, xs, M, add, y);
    } else if (L.kind == 1) {
        fs.resize(M * (K / L.G));
        if (L.mins) group_sums(x, M, K, L.G, fs.data());
        gemm<true>(x, M, K, L.w, (const float*)L.scale, (const float*)L.mins, L.N, L.G, add, L.bias, y, fs.data());
    } else {
        gemm<false>(x, M, K, L.w, (const float*)L.scale, nullptr, L.N, L.G, add, L.bias, y, nullptr);
    }
}

// h = x * rsqrt(mean(x^2) + eps) * w, row by row (the sum of squares per 8 lanes, then the lanes)
static void rms_rows(const float* x, int64_t T, int64_t d, const float* w, float eps, float* h) {
    for_rows(T, [&](int64_t t) {
        const float* xr = x + t * d;
        __m256 s = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= d; k += 8) {
            const __m256 v = _mm256_loadu_ps(xr + k);
            s = _mm256_fmadd_ps(v, v, s);
        }
        float ss = hsum8(s);
        for (; k < d; k++) ss += xr[k] * xr[k];
        const float r = 1.0f / sqrtf(ss / (float)d + eps);
        for (k = 0; k < d; k++) h[t * d + k] = (xr[k] * r) * w[k];
    });
}

// RoPE (rotate_half convention) on the first nh heads of each row of qkv [T, stride]
static void rope_rows(float* qkv, int64_t T, int64_t stride, int64_t nh, int64_t D, const float* cos,
                      const float* sin, const int64_t* pos) {
    const int64_t h2 = D / 2;
    for_rows(T, [&](int64_t t) {
        const float *c = cos + pos[t] * D, *s = sin + pos[t] * D;
        for (int64_t hh = 0; hh < nh; hh++) {
            float* v = qkv + t * stride + hh * D;
            for (int64_t i = 0; i < h2; i++) {
                const float a = v[i], b = v[i + h2];
                v[i] = a * c[i] - b * s[i];
                v[i + h2] = b * c[i + h2] + a * s[i + h2];
            }
        }
    });
}

// a[t, j] = silu(gu[t, j]) * gu[t, inter + j]; silu(x) = x * (x >= 0 ? 1 : e) / (1 + e), e = exp(-|x|)
static void silu_mul_rows(const float* gu, int64_t T, int64_t inter, float* a) {
    const __m256 one = _mm256_set1_ps(1.0f), signbit = _mm256_set1_ps(-0.0f);
    for_rows(T, [&](int64_t t) {
        const float *g = gu + t * 2 * inter, *u = g + inter;
        float* o = a + t * inter;
        int64_t j = 0;
        for (; j + 8 <= inter; j += 8) {
            const __m256 x = _mm256_loadu_ps(g + j);
            const __m256 e = exp_nonpos(_mm256_or_ps(x, signbit));  // exp(-|x|)
            const __m256 num = _mm256_blendv_ps(e, one, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_GE_OQ));
            const __m256 sv = _mm256_div_ps(_mm256_mul_ps(x, num), _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(sv, _mm256_loadu_ps(u + j)));
        }
        for (; j < inter; j++) {
            const float x = g[j], e = expf(-fabsf(x));
            o[j] = x * (x >= 0.f ? 1.f : e) / (1.f + e) * u[j];
        }
    });
}

// A K or V row into the cache: fp32 as is, fp16 rounded to nearest even (as torch's .to(float16))
static inline void store_row(float* dst, const float* src, int64_t n) { memcpy(dst, src, n * sizeof(float)); }
static inline void store_row(half_t* dst, const float* src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// The step's new keys and values (rows of qkv after the q heads) into their cache slots, then the
// attention of every row over the paged cache (kv [2, nslots, KVH, D] of E: float or half_t)
template <class E>
static void write_and_attend(E* kv, const float* qkv, int64_t T, int64_t stride, int64_t H, int64_t KVH, int64_t D,
                             int64_t nslots, const int64_t* slot_mapping, const int32_t* qsl, int64_t B,
                             const int32_t* bt, int64_t maxb, int64_t BS, const float* bias, int64_t Qm, int64_t Lp,
                             float scale, float* o) {
    const int64_t nq = H * D, nkv = KVH * D;
    for_rows(T, [&](int64_t t) {
        const int64_t s = slot_mapping[t];
        store_row(kv + s * nkv, qkv + t * stride + nq, nkv);
        store_row(kv + (nslots + s) * nkv, qkv + t * stride + nq + nkv, nkv);
    });
    if (!paged_attention_2p(qkv, stride, H, KVH, D, (const E*)kv, nslots, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, o))
        paged_attention(qkv, stride, H, KVH, D, (const E*)kv, nslots, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, o);
}

// One decoder layer (as above), or with e != nullptr a feature head's (specd/model/head.py): its
// q/k/v projection reads [rms(e) * w_e, rms(x) * w_in] (2d wide per row) instead of rms(x) * w_in.
static void decoder_layer(float* x, const float* e, const float* w_e, int64_t T, int64_t d, const float* w_in,
                          const float* w_post, float eps, const Lin* lins, int64_t H, int64_t KVH, int64_t D,
                          int64_t inter, const float* cos, const float* sin, const int64_t* pos, void* kv,
                          int64_t nslots, const int64_t* slot_mapping, const int32_t* qsl, int64_t B,
                          const int32_t* bt, int64_t maxb, int64_t BS, const float* bias, int64_t Qm, int64_t Lp,
                          float scale, int64_t kv16) {
    const int64_t din = e ? 2 * d : d;
    // the calling thread's scratch, kept between calls (grown, never cleared: every element read is
    // written first; fresh vectors cost page faults on every layer of every step)
    static thread_local std::vector<float> fs, h, qkv, o, gu, a, xp;
    static thread_local std::vector<int8_t> qs;
    grow(h, T * din), grow(qkv, T * (H + 2 * KVH) * D), grow(o, T * H * D), grow(gu, T * 2 * inter), grow(a, T * inter);
    const int64_t nq = H * D, nkv = KVH * D, stride = nq + 2 * nkv;
    if (e) {
        for (int64_t t = 0; t < T; t++) {
            rms_rows(e + t * d, 1, d, w_e, eps, h.data() + t * din);
            rms_rows(x + t * d, 1, d, w_in, eps, h.data() + t * din + d);
        }
    } else {
        rms_rows(x, T, d, w_in, eps, h.data());
    }
    lin(lins[0], h.data(), T, nullptr, qkv.data(), fs, qs, xp);
    rope_rows(qkv.data(), T, stride, H + KVH, D, cos, sin, pos);
    if (kv16)
        write_and_attend((half_t*)kv, qkv.data(), T, stride, H, KVH, D, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias,
                         Qm, Lp, scale, o.data());
    else
        write_and_attend((float*)kv, qkv.data(), T, stride, H, KVH, D, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias,
                         Qm, Lp, scale, o.data());
    lin(lins[1], o.data(), T, x, x, fs, qs, xp);
    rms_rows(x, T, d, w_post, eps, h.data());
    lin(lins[2], h.data(), T, nullptr, gu.data(), fs, qs, xp);
    silu_mul_rows(gu.data(), T, inter, a.data());
    lin(lins[3], a.data(), T, x, x, fs, qs, xp);
}
