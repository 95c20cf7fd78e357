// The int8-activation GEMM on AVX512-VNNI (x8_isa 1; under AMX, the calls too narrow for its tiles
// and a pass's few tail rows): two 8-row tiles of the x8 layout per 512-bit vector, vpdpbusd
// (gemm_x8_512); 1-4 rows run one tile at a time, two of its vectors per register (x8_tile1).
// ISA: AVX512F/BW/DQ/VNNI through the X512 attribute. Relies on common.h (X512, half_t) and
// gemm_x8_avx2.h (the layout, prefetch_w, X8_RB, x8_store); gemm_x8_amx.h reuses its loads (cat256,
// cat256ps), x8_pass2, x8_store16 and tile pairs.
#pragma once

#include "common.h"
#include "gemm_x8_avx2.h"

// ---- the same tiles on AVX512-VNNI (chosen at run time where the CPU has it) ----------------------
// Two 8-row tiles side by side in one 512-bit vector (16 output rows), and vpdpbusd (64 products summed
// into int32 per instruction) in place of maddubs + add + madd. The integer sums are exact in both
// (the int16 sums of the AVX2 path never saturate, see above), and the fp32 steps per output element
// (cvt, dw * dx, fma, the min's fma, block by block) are the same instructions lane by lane: the
// results are bitwise those of x8_tile, so which path runs never changes a token.

X512 static inline __m512i cat256(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}

X512 static inline __m512 cat256ps(const float* a, const float* b) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

// the same from halves (block scales or mins stored as fp16), widened exactly
X512 static inline __m512 cat256ps(const half_t* a, const half_t* b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                                   _mm_loadu_si128((const __m128i*)b), 1));
}

X512 static inline __m512i bcast4_512(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// a block's mins of tiles a and b (int4): stored (ma, mb), or -8 x the scales dw (off8: GGUF Q4_0's,
// exact in fp32, so the bits of the stored -8 d), else zero
template <bool INT4, class S>
X512 static inline __m512 x8_mins512(const S* ma, const S* mb, int64_t b, __m512 dw, bool off8) {
    if (!INT4) return _mm512_setzero_ps();
    if (ma) return cat256ps(ma + 8 * b, mb + 8 * b);
    return off8 ? _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps();
}

// tiles a and b (their weights wa / wb, scales sa / sb, mins ma / mb, or off8): out [R, 16], a's 8 rows then b's
template <bool INT4, int R, class S>
X512 static inline void x8_tile2(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* wa,
                                 const uint8_t* wb, const S* sa, const S* sb, const S* ma, const S* mb, bool off8,
                                 float* out) {
    const int64_t nbk = K / 32;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m512 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        __m512i is[R];
        for (int r = 0; r < R; r++) is[r] = _mm512_setzero_si512();
        const int8_t* xb = qx + 32 * b;
        if (INT4) {
            const uint8_t *pa = wa + 128 * b, *pb = wb + 128 * b;
            prefetch_w2(pa, 128 * b, 128 * nbk, 128), prefetch_w2(pb, 128 * b, 128 * nbk, 128);
            for (int v = 0; v < 4; v++) {
                const __m512i W = cat256(pa + 32 * v, pb + 32 * v);
                const __m512i lo = _mm512_and_si512(W, mask), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), mask);
                for (int r = 0; r < R; r++) {
                    is[r] = _mm512_dpbusd_epi32(is[r], lo, bcast4_512(xb + r * K + 4 * v));
                    is[r] = _mm512_dpbusd_epi32(is[r], hi, bcast4_512(xb + r * K + 16 + 4 * v));
                }
            }
        } else {
            const uint8_t *pa = wa + 256 * b, *pb = wb + 256 * b;
            prefetch_w2(pa, 256 * b, 256 * nbk, 256), prefetch_w2(pb, 256 * b, 256 * nbk, 256);
            for (int s = 0; s < 8; s++) {
                const __m512i W = cat256(pa + 32 * s, pb + 32 * s);
                const __m512i aw = _mm512_abs_epi8(W);
                const __mmask64 neg = _mm512_movepi8_mask(W);  // w < 0: the activation byte is negated
                for (int r = 0; r < R; r++) {
                    const __m512i x = bcast4_512(xb + r * K + 4 * s);
                    const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                    // sign_epi8 zeroes x where w == 0; |w| = 0 there, so the product is 0 either way
                    is[r] = _mm512_dpbusd_epi32(is[r], aw, sx);
                }
            }
        }
        const __m512 dw = cat256ps(sa + 8 * b, sb + 8 * b);
        const __m512 mv = x8_mins512<INT4>(ma, mb, b, dw, off8);
        for (int r = 0; r < R; r++) {
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * nbk + b])),
                                     acc[r]);
            if (INT4 && (ma || off8)) acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xs[r * nbk + b]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out + 16 * r, acc[r]);
}

// ---- 1-4 rows against one tile at a time on AVX512-VNNI (decode steps, short verifications) -------------
// Tile pairs (below) read two streams tile_bytes apart (and two of scales); a few rows do too little work per
// byte to hide that: 1.7B Q4_0 decode steps on one Zen 5 core took 1.32x as long with pairs at 1 row, 1.35x
// at 2, 1.05x at 4 (from 5 rows on, the pairs' fewer instructions per weight pay). Here a 512-bit register
// holds vectors v and v + 1 of one tile's block (64 contiguous bytes: the same 8 output rows, k groups v and
// v + 1 in its halves), multiplied by activation dwords v and v + 1 broadcast over those halves (a permute of
// the block's 8 dwords); the halves' int32 sums are added once per block. The integers are exact and the fp32 steps per
// output element are x8_tile's (cvt, dw * dx, fma, the min's fma, block by block, on 8 lanes): the same bits.

// dwords j (low half) and j + 1 (high half) of a block's 8 activation dwords xd
X512 static inline __m512i x_pair(__m512i xd, int j) {
    return _mm512_permutexvar_epi32(_mm512_inserti64x4(_mm512_set1_epi32(j), _mm256_set1_epi32(j + 1), 1), xd);
}

X512 static inline __m256i halves_sum(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

// R rows of x (codes qx, scales dx, sums xs) against tile w (scales sc, mins mn or off8): out [R, 8]
template <bool INT4, int R, class S>
X512 static inline void x8_tile1(const int8_t* qx, const float* dx, const float* xs, int64_t K, const uint8_t* w,
                                 const S* sc, const S* mn, bool off8, float* out) {
    const int64_t nbk = K / 32;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbk; b++) {
        __m512i is[R], xd[R];
        for (int r = 0; r < R; r++) {
            is[r] = _mm512_setzero_si512();
            xd[r] = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(qx + r * K + 32 * b)));
        }
        if (INT4) {
            const uint8_t* wb = w + 128 * b;
            prefetch_w(wb, 128);
            for (int h = 0; h < 2; h++) {  // vectors 2h, 2h + 1
                const __m512i W = _mm512_loadu_si512((const void*)(wb + 64 * h));
                const __m512i lo = _mm512_and_si512(W, mask), hi = _mm512_and_si512(_mm512_srli_epi16(W, 4), mask);
                for (int r = 0; r < R; r++) {
                    is[r] = _mm512_dpbusd_epi32(is[r], lo, x_pair(xd[r], 2 * h));
                    is[r] = _mm512_dpbusd_epi32(is[r], hi, x_pair(xd[r], 4 + 2 * h));
                }
            }
        } else {
            const uint8_t* wb = w + 256 * b;
            prefetch_w(wb, 256);
            for (int h = 0; h < 4; h++) {  // steps 2h, 2h + 1
                const __m512i W = _mm512_loadu_si512((const void*)(wb + 64 * h));
                const __m512i aw = _mm512_abs_epi8(W);
                const __mmask64 neg = _mm512_movepi8_mask(W);
                for (int r = 0; r < R; r++) {
                    const __m512i x = x_pair(xd[r], 2 * h);
                    is[r] = _mm512_dpbusd_epi32(is[r], aw, _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
                }
            }
        }
        const __m256 dw = ld8(sc + 8 * b);
        const __m256 mv = !INT4 ? _mm256_setzero_ps() : mn ? ld8(mn + 8 * b)
                          : off8 ? _mm256_mul_ps(dw, _mm256_set1_ps(-8.0f)) : _mm256_setzero_ps();
        for (int r = 0; r < R; r++) {
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(halves_sum(is[r])),
                                     _mm256_mul_ps(dw, _mm256_broadcast_ss(dx + r * nbk + b)), acc[r]);
            if (INT4 && (mn || off8)) acc[r] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(xs + r * nbk + b), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

// the calls of 1 to X8_TILE1_ROWS rows: x8_tile1 tile by tile
#define X8_TILE1_ROWS 4
template <bool INT4, class S>
X512 static void gemm_x8_512_rows(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K,
                                  const uint8_t* w, const S* scale, const S* mins, bool off8, int64_t N,
                                  const float* add, const float* bias, float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < NT; t++) {
        alignas(32) float acc[X8_TILE1_ROWS * 8];
        const uint8_t* wt = w + t * tile_bytes;
        const S *st = scale + t * nbk * 8, *mt = mins ? mins + t * nbk * 8 : nullptr;
        switch (M) {
            case 1: x8_tile1<INT4, 1, S>(qx, dx, xs, K, wt, st, mt, off8, acc); break;
            case 2: x8_tile1<INT4, 2, S>(qx, dx, xs, K, wt, st, mt, off8, acc); break;
            case 3: x8_tile1<INT4, 3, S>(qx, dx, xs, K, wt, st, mt, off8, acc); break;
            default: x8_tile1<INT4, 4, S>(qx, dx, xs, K, wt, st, mt, off8, acc);
        }
        x8_store(acc, M, 0, 8 * t, N - 8 * t < 8 ? N - 8 * t : 8, N, add, bias, y);
    }
}

template <bool INT4, class S>
X512 static inline void x8_pass2(int64_t r, const int8_t* xm, const float* dm, const float* sm, int64_t K,
                                 const uint8_t* wa, const uint8_t* wb, const S* sa, const S* sb, const S* ma,
                                 const S* mb, bool off8, float* acc) {
#define X8_CASE(n) \
    case n: x8_tile2<INT4, n, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, off8, acc); break;
    switch (r) {
        X8_CASE(8) X8_CASE(7) X8_CASE(6) X8_CASE(5) X8_CASE(4) X8_CASE(3) X8_CASE(2)
        default: x8_tile2<INT4, 1, S>(xm, dm, sm, K, wa, wb, sa, sb, ma, mb, off8, acc);
    }
#undef X8_CASE
}

// x8_store (the same adds in the same order per element: the same bits) for acc rows of 16 columns on
// AVX512: a masked vector per row instead of a scalar loop with two tests per element (3-8% of the
// GEMMs at 4-32 rows)
X512 static inline void x8_store16(const float* acc, int64_t r, int64_t m0, int64_t n0, int64_t nc, int64_t N,
                                   const float* add, const float* bias, float* y) {
    const __mmask16 k = nc >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nc) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(k, bias + n0) : _mm512_setzero_ps();
    for (int64_t i = 0; i < r; i++) {
        const int64_t m = m0 + i;
        __m512 v = _mm512_loadu_ps(acc + 16 * i);
        if (bias) v = _mm512_add_ps(v, bv);
        if (add) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(k, add + m * N + n0));
        _mm512_mask_storeu_ps(y + m * N + n0, k, v);
    }
}

// Output tile pair p of an x8-layout weight (tiles ta, tb; an odd last tile pairs with itself and its
// copy is dropped): its first output row n0, its nc live columns, each tile's mins (int4) or null
template <class S>
struct TilePair {
    int64_t ta, tb, n0, nc;
    const S *ma, *mb;
};

template <class S>
static inline TilePair<S> tile_pair(int64_t p, int64_t NT, int64_t N, int64_t nbk, const S* mins) {
    const int64_t ta = 2 * p, tb = ta + 1 < NT ? ta + 1 : ta, n0 = 8 * ta;
    const int64_t nc = tb == ta ? (N - n0 < 8 ? N - n0 : 8) : (N - n0 < 16 ? N - n0 : 16);
    return {ta, tb, n0, nc, mins ? mins + ta * nbk * 8 : nullptr, mins ? mins + tb * nbk * 8 : nullptr};
}

template <bool INT4, class S>
X512 static void gemm_x8_512(const int8_t* qx, const float* dx, const float* xs, int64_t M, int64_t K,
                             const uint8_t* w, const S* scale, const S* mins, bool off8, int64_t N, const float* add,
                             const float* bias, float* y) {
    const int64_t nbk = K / 32, NT = (N + 7) / 8, tile_bytes = nbk * (INT4 ? 128 : 256);
    const int64_t passes = (M + X8_RB - 1) / X8_RB, rp = (M + passes - 1) / passes;
    if (M <= X8_TILE1_ROWS) return gemm_x8_512_rows<INT4, S>(qx, dx, xs, M, K, w, scale, mins, off8, N, add, bias, y);
    const int64_t NP = (NT + 1) / 2;  // tile pairs; an odd last tile pairs with itself (its copy is dropped)
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < NP; p++) {
        const TilePair<S> tp = tile_pair(p, NT, N, nbk, mins);
        const int64_t ta = tp.ta, tb = tp.tb, n0 = tp.n0, nc = tp.nc;
        const S *ma = tp.ma, *mb = tp.mb;
        alignas(64) float acc[X8_RB * 16];
        for (int64_t m0 = 0; m0 < M; m0 += rp) {
            const int64_t r = M - m0 < rp ? M - m0 : rp;
            x8_pass2<INT4, S>(r, qx + m0 * K, dx + m0 * nbk, xs + m0 * nbk, K, w + ta * tile_bytes, w + tb * tile_bytes,
                           scale + ta * nbk * 8, scale + tb * nbk * 8, ma, mb, off8, acc);
            x8_store16(acc, r, m0, n0, nc, N, add, bias, y);
        }
    }
}
