// The int8-activation GEMM: what its three paths share (the interleaved "x8" weight layout below, the
// weights' software prefetch, X8_RB, x8_store) and its AVX2 path (x8_tile, gemm_x8_256; x8_isa 0).
// ISA: AVX2 (maddubs); SPECD_QGEMM_PREFETCH sets the prefetch distance. Relies on common.h (half_t,
// ld8); the AVX512-VNNI and AMX paths (gemm_x8_avx512.h, gemm_x8_amx.h) give the same bits from the
// same layout, and gemm_x8.h picks one per call.
//
// specd_qgemm_x8 (int8 activations) quantizes each row of x to int8 first (blocks of 32: d = max|x| /
// 127, q = round(x / d), GGUF Q8_0 / llama.cpp's activation format) and multiplies codes by codes in
// integers (maddubs: 32 products per instruction) from the interleaved weight layout of gemm_x8, each
// 32-block's integer sum then scaled in fp32.
// A row's result still depends on that row alone (its own blocks and scales), so speculation stays
// lossless; it is no longer equal to the fp32-activation result (a relative error ~1e-3 per output).
// Its block scales and mins are fp16 where they are halves exactly (GGUF's own, as llama.cpp reads
// them): 20 bytes per int4 block instead of 24, the same bits; a decode step streams its weights from
// memory (2-core Xeon: the int8-activation GEMMs of a step from L3 twice as long as from L2), so the
// smaller stream made a whole plain step ~20% faster there.
#pragma once

#include "common.h"

// The x8 kernels' weights stream from memory once per call (a layer's are far larger than L2), each
// tile's blocks in order and a pass's tiles side by side in one contiguous run: the hardware's
// prefetchers stop at 4 KiB pages and fall behind once a pass also computes several rows, so each
// block asks for the bytes W_PREFETCH ahead of itself (measured on a 2-core Xeon, whole forward at a
// short context against no prefetch: 1 row -20%, 4 rows -30%; 8 KiB beat 1-4 KiB and tied 16 KiB;
// past the end of a weight it only wastes a few lines). SPECD_QGEMM_PREFETCH sets it (0: off).
static const int64_t W_PREFETCH = getenv("SPECD_QGEMM_PREFETCH") ? atol(getenv("SPECD_QGEMM_PREFETCH")) : 8192;

static inline void prefetch_w(const uint8_t* p, int64_t bytes) {
    if (W_PREFETCH > 0)
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch((const char*)p + W_PREFETCH + c, _MM_HINT_T0);
}

// The same for one of a tile pair's two streams (the AVX512 and AMX paths compute tiles 2p and 2p + 1 together):
// memory holds [A_p][B_p][A_p+1][B_p+1].., each tile tile_bytes long, so the bytes W_PREFETCH ahead of a stream's
// block at offset o in its tile lie in that stream's own later tiles, one tile_bytes further per tile boundary
// crossed. (The plain distance landed on the other stream's tile, being read already, and left the next pair's
// second tile to the hardware: a 1.7B Q4_K_M decode step on one Zen 5 core took 1.44x as long before this.)
static inline void prefetch_w2(const uint8_t* p, int64_t o, int64_t tile_bytes, int64_t bytes) {
    if (W_PREFETCH > 0) {
        const char* q = (const char*)p + W_PREFETCH + (o + W_PREFETCH) / tile_bytes * tile_bytes;
        for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(q + c, _MM_HINT_T0);
    }
}

// The interleaved ("x8") layout for int8 activations: output rows in tiles of 8 (zero rows pad the
// last tile), and within a tile, per 32-block of k, 8 steps of 4 consecutive k for the 8 rows, so one
// 32-byte vector holds 4 weights for each of 8 output rows and a broadcast of 4 activation bytes
// multiplies all 8 rows at once (maddubs): the 8 outputs stay in the 8 lanes of one accumulator (no
// horizontal sums), and an int4 block's 8 steps sum in int16 before one widening (|sum| <= 8 * 2 *
// 15 * 127 < 2^15). A tile's weights are read once per call and kept in L1 for the next rows.
//   int4: per (tile, block) 128 bytes, vector v (0..3) byte 4c + i: low nibble code[8t + c][32b + 4v + i],
//         high nibble code[8t + c][32b + 16 + 4v + i]
//   int8: per (tile, block) 256 bytes, vector s (0..7) byte 4c + i: q[8t + c][32b + 4s + i]
//   scale, min: [tiles, K/32, 8] (a group of G > 32 repeated per block), fp32 or fp16 (S: half_t); off8:
//         no min stored, min = -8 x scale computed per block (GGUF Q4_0, X8_OFF8 in layer.h: the same bits)
// A row's outputs: per block in order, acc = fma(float(isum), dw * dx, acc) then (int4 with mins)
// acc = fma(min, xsum_block, acc), xsum_block the fp32 sum of the row's 32 activations: the same ops
// for every row whatever M is, so a row's result depends on that row alone.
static inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

template <bool INT4, int R, class S>
static inline void x8_tile(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* w,
                           const S* sc, const S* mn, bool off8, float* out /* [R, 8] */) {
    const int64_t nbk = K / 32;
    const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        __m256i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm256_setzero_si256();
        const int8_t* xb = qx + 32 * b;
        if (INT4) {
            const uint8_t* wb = w + 128 * b;
            prefetch_w(wb, 128);
            for (int v = 0; v < 4; v++) {
                const __m256i W = _mm256_loadu_si256((const __m256i*)(wb + 32 * v));
                const __m256i lo = _mm256_and_si256(W, mask), hi = _mm256_and_si256(_mm256_srli_epi16(W, 4), mask);
                for (int r = 0; r < R; r++) {
                    is[r] = _mm256_add_epi16(is[r], _mm256_maddubs_epi16(lo, bcast4(xb + r * K + 4 * v)));
                    is[r] = _mm256_add_epi16(is[r], _mm256_maddubs_epi16(hi, bcast4(xb + r * K + 16 + 4 * v)));
                }
            }
            for (int r = 0; r < R; r++) is[r] = _mm256_madd_epi16(is[r], ones);
        } else {
            const uint8_t* wb = w + 256 * b;
            prefetch_w(wb, 256);
            for (int s = 0; s < 8; s++) {
                const __m256i W = _mm256_loadu_si256((const __m256i*)(wb + 32 * s));
                const __m256i aw = _mm256_sign_epi8(W, W);
                for (int r = 0; r < R; r++) {
                    const __m256i p = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bcast4(xb + r * K + 4 * s), W));
                    is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(p, ones));
                }
            }
        }
        const __m256 dw = ld8(sc + 8 * b);
        const __m256 mv = !INT4 ? _mm256_setzero_ps() : mn ? ld8(mn + 8 * b)
                          : off8 ? _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), _mm256_mul_ps(dw, _mm256_broadcast_ss(dx + r * nbk + b)),
                                     acc[r]);
            if (INT4 && (mn || off8)) acc[r] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(xs + r * nbk + b), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// Up to X8_RB rows of x per pass over a tile; M rows split into equal passes (9 = 5 + 4, not 8 + 1:
// a one-row pass costs nearly what a full one does).
#define X8_RB 8

template <bool INT4, class S>
static inline void x8_pass(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K,
                           const uint8_t* wt, const S* st, const S* mt, bool off8, float* acc) {
    switch (r) {
        case 8: x8_tile<INT4, 8, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 7: x8_tile<INT4, 7, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 6: x8_tile<INT4, 6, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 5: x8_tile<INT4, 5, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 4: x8_tile<INT4, 4, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 3: x8_tile<INT4, 3, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        case 2: x8_tile<INT4, 2, S>(xm, dm, sm, K, wt, st, mt, off8, acc); break;
        default: x8_tile<INT4, 1, S>(xm, dm, sm, K, wt, st, mt, off8, acc);
    }
}

// y's rows m0 .. m0+r-1, columns n0 .. n0+nc-1 from acc [r, 8] (+ bias, + add)
static inline void x8_store(const float* acc, int64_t r, int64_t m0, int64_t n0, int64_t nc, int64_t N,
                            const float* add, const float* bias, float* y) {
    for (int64_t i = 0; i < r; i++) {
        const int64_t m = m0 + i;
        for (int64_t j = 0; j < nc; j++) {
            float v = acc[8 * i + j];
            if (bias) v += bias[n0 + j];
            if (add) v += add[m * N + n0 + j];
            y[m * N + n0 + j] = v;
        }
    }
}

// The AVX2 path: one 8-row tile per task, M rows in equal passes of up to X8_RB rows over it
template <bool INT4, class S>
static void gemm_x8_256(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                        const S* scale, const S* mins, bool off8, int64_t N, const float* add, const float* bias,
                        float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        const uint8_t* wt = w + t * tile_bytes;
        const S* st = scale + t * nbk * 8;
        const S* mt = mins ? mins + t * nbk * 8 : nullptr;
        const int64_t n0 = 8 * t, nc = N - n0 < 8 ? N - n0 : 8;
        alignas(32) float acc[X8_RB * 8];
        for (int64_t m0 = 0; m0 < M; m0 += rp) {
            const int64_t r = M - m0 < rp ? M - m0 : rp;
            x8_pass<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, wt, st, mt, off8, acc);
            x8_store(acc, r, m0, n0, nc, N, add, bias, y);
        }
    }
}
