// The attention's scores, paged and gathered alike: q . k per query row and key, scaled and masked,
// into a score row per query (score_rows from keys packed whole: pack_kt; score_keys /
// score_keys_512 from the paged cache's rows, 8 keys transposed at a time in L1: pack8). Each score
// is its own vector lane's sum over d in order, whatever rows or keys share the vector. ISA: AVX2 +
// FMA; the *_512 functions AVX512F through X512 (att_avx512). Relies on common.h (ld8, ld1,
// KV_PREFETCH); softmax.h and weighted_sums.h take the score rows on from here, attention.h calls
// these.
#pragma once

#include "common.h"

// q . k over D (not called at present: the scores below sum over d in vector lanes instead)
static inline float dot_d(const float* a, const float* b, int64_t D) {
    __m256 s = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= D; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float t = hsum8(s);
    for (; i < D; i++) t += a[i] * b[i];
    return t;
}

// Rows r0 .. r0+nr-1 of one (sequence, KV head): they share its keys and values. Scores come 8 keys
// at a time from the keys transposed (KT [D, L8], packed by the caller): each score is a sum over d
// in order 0..D-1 in one vector lane, the same computation for every row and key whichever rows or
// keys share the vector. S: scratch [nr, L8] (L8 = L rounded up to 8).
// NI rows' scores for keys j .. j+7: sum over d in order, one lane per key
template <int NI>
static inline void scores8(const float* q, int64_t D, const float* KT, int64_t L8, int64_t j, __m256* acc) {
    for (int i = 0; i < NI; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m256 kd = _mm256_loadu_ps(KT + d * L8 + j);
        for (int i = 0; i < NI; i++) acc[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(q + i * D + d), kd, acc[i]);
    }
}

// rows a .. a+ni-1's scores of keys j .. j+7 (acc) scaled, masked (row r uses mask row r % Q) and
// stored at S [ni, L8] column j; a masked key is -inf whatever its (possibly uninitialised) key held
static inline void store_scores(const __m256* acc, int64_t ni, int64_t a, int64_t j, const float* mask, int64_t Q,
                                int64_t L, float scale, float* S, int64_t L8) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), sc8 = _mm256_set1_ps(scale);
    float mtmp[8];
    for (int64_t i = 0; i < ni; i++) {
        const float* mrow = mask + ((a + i) % Q) * L;
        __m256 mk;
        if (j + 8 <= L) {
            mk = _mm256_loadu_ps(mrow + j);
        } else {
            for (int t = 0; t < 8; t++) mtmp[t] = j + t < L ? mrow[j + t] : -INFINITY;
            mk = _mm256_loadu_ps(mtmp);
        }
        const __m256 sv = _mm256_add_ps(_mm256_mul_ps(acc[i], sc8), mk);
        _mm256_storeu_ps(S + i * L8 + j, _mm256_blendv_ps(sv, ninf, _mm256_cmp_ps(mk, ninf, _CMP_EQ_OQ)));
    }
}

static void score_rows(const float* q, int64_t r0, int64_t nr, const float* KT, const float* mask, int64_t Q,
                       int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    __m256 acc[4];
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
        const float* qi = q + (r0 + i0) * D;
        for (int64_t j = 0; j < L8; j += 8) {
            switch (ni) {
                case 4: scores8<4>(qi, D, KT, L8, j, acc); break;
                case 3: scores8<3>(qi, D, KT, L8, j, acc); break;
                case 2: scores8<2>(qi, D, KT, L8, j, acc); break;
                default: scores8<1>(qi, D, KT, L8, j, acc);
            }
            store_scores(acc, ni, r0 + i0, j, mask, Q, L, scale, S + i0 * L8, L8);
        }
    }
}

static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Keys j .. j+7 of the keys behind ``kptr`` (one pointer per key, the paged cache's rows; zero past
// L) transposed into KT8 [D, 8]: the 8-key slice of pack_kt's KT, built in L1 where it is used.
template <class T>
static inline void prefetch_rows(const T* const* ptr, int64_t j, int64_t n, int64_t L, int64_t bytes) {
    for (int64_t t = j; t < j + n && t < L; t++)
        for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)ptr[t] + b, _MM_HINT_T0);
}

template <class T>
static inline void pack8(const T* const* kptr, int64_t j, int64_t L, int64_t D, float* KT8, int64_t ld = 8) {
    prefetch_rows(kptr, j + KV_PREFETCH, 8, L, D * sizeof(T));
    if (D % 8 == 0) {
        for (int64_t d = 0; d < D; d += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++) r[t] = j + t < L ? ld8(kptr[j + t] + d) : _mm256_setzero_ps();
            transpose8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(KT8 + (d + t) * ld, r[t]);
        }
        return;
    }
    for (int64_t d = 0; d < D; d++)
        for (int t = 0; t < 8; t++) KT8[d * ld + t] = j + t < L ? ld1(kptr[j + t] + d) : 0.f;
}

// score_rows for keys j0 .. j1-1 (multiples of 8) read through ``kptr`` (no packed copy of the keys):
// the same scores, bit for bit (the same 8-key vectors, the same sum over d in order), keys in the
// outer loop; rows r0 .. r0+nr-1 of q (mask row r % Q) into S [nr, L8] (L8 = L rounded up to 8).
template <class T>
static void score_keys(const float* q, int64_t r0, int64_t nr, const T* const* kptr, int64_t j0, int64_t j1,
                       const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    alignas(32) float KT8[8 * 256];  // head_dim <= 256 (checked by the caller: fused.py)
    __m256 acc[4];
    prefetch_rows(kptr, j0, KV_PREFETCH, L, D * sizeof(T));  // (pack8 asks for the later ones)
    for (int64_t j = j0; j < j1; j += 8) {
        pack8(kptr, j, L, D, KT8);
        for (int64_t i0 = 0; i0 < nr; i0 += 4) {
            const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
            const float* qi = q + (r0 + i0) * D;
            switch (ni) {
                case 4: scores8<4>(qi, D, KT8, 8, 0, acc); break;
                case 3: scores8<3>(qi, D, KT8, 8, 0, acc); break;
                case 2: scores8<2>(qi, D, KT8, 8, 0, acc); break;
                default: scores8<1>(qi, D, KT8, 8, 0, acc);
            }
            store_scores(acc, ni, r0 + i0, j, mask, Q, L, scale, S + i0 * L8, L8);
        }
    }
}

// keys of one (sequence, KV head) transposed: KT [D, L8], zero past L (a copy: exact)
static void pack_kt(const float* kb, int64_t L, int64_t KVH, int64_t D, float* KT) {
    const int64_t L8 = (L + 7) / 8 * 8;
    if (D % 8 == 0) {
        for (int64_t j = 0; j < L8; j += 8)
            for (int64_t d = 0; d < D; d += 8) {
                __m256 r[8];
                for (int t = 0; t < 8; t++)
                    r[t] = j + t < L ? _mm256_loadu_ps(kb + (j + t) * KVH * D + d) : _mm256_setzero_ps();
                transpose8(r);
                for (int t = 0; t < 8; t++) _mm256_storeu_ps(KT + (d + t) * L8 + j, r[t]);
            }
        return;
    }
    for (int64_t d = 0; d < D; d++)
        for (int64_t j = L; j < L8; j++) KT[d * L8 + j] = 0.f;
    for (int64_t j = 0; j < L; j++) {
        const float* kj = kb + j * KVH * D;
        for (int64_t d = 0; d < D; d++) KT[d * L8 + j] = kj[d];
    }
}

// ---- the paged attention's scores and weighted sums on AVX512 (where the kernel's instruction set is
// AVX512-VNNI or AMX: x8_isa): 16 keys per score vector, a 64-wide value row in 4 vectors. Each score
// is still its own lane's sum over d in order, and each output element its own fma chain over keys
// in order: the AVX2 functions' bits.

template <int NI>
X512 static inline void scores16(const float* q, int64_t D, const float* KT16, __m512* acc) {
    for (int i = 0; i < NI; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 kd = _mm512_load_ps(KT16 + d * 16);
        for (int i = 0; i < NI; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i * D + d]), kd, acc[i]);
    }
}

// scores16 for 32 keys (KT32 [D, 32]): each query broadcast feeds two key vectors, so a pass is
// bound by the FMAs rather than the loads; acc[i] keys 0-15, acc[4 + i] keys 16-31
template <int NI>
X512 static inline void scores32(const float* q, int64_t D, const float* KT32, __m512* acc) {
    for (int i = 0; i < NI; i++) acc[i] = acc[4 + i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d++) {
        const __m512 k0 = _mm512_load_ps(KT32 + d * 32), k1 = _mm512_load_ps(KT32 + d * 32 + 16);
        for (int i = 0; i < NI; i++) {
            const __m512 qb = _mm512_set1_ps(q[i * D + d]);
            acc[i] = _mm512_fmadd_ps(qb, k0, acc[i]), acc[4 + i] = _mm512_fmadd_ps(qb, k1, acc[4 + i]);
        }
    }
}

// store_scores for keys j .. j+15
X512 static inline void store_scores16(const __m512* acc, int64_t ni, int64_t a, int64_t j, const float* mask,
                                       int64_t Q, int64_t L, float scale, float* S, int64_t L8) {
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sc = _mm512_set1_ps(scale);
    alignas(64) float mtmp[16];
    for (int64_t i = 0; i < ni; i++) {
        const float* mrow = mask + ((a + i) % Q) * L;
        __m512 mk;
        if (j + 16 <= L) {
            mk = _mm512_loadu_ps(mrow + j);
        } else {
            for (int t = 0; t < 16; t++) mtmp[t] = j + t < L ? mrow[j + t] : -INFINITY;
            mk = _mm512_load_ps(mtmp);
        }
        const __m512 sv = _mm512_add_ps(_mm512_mul_ps(acc[i], sc), mk);
        _mm512_storeu_ps(S + i * L8 + j, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mk, ninf, _CMP_EQ_OQ), sv, ninf));
    }
}

// scores16 or scores32 by NK
template <int NK, int NI>
X512 static inline void scores_nk(const float* qi, int64_t D, const float* KT, __m512* acc) {
    if constexpr (NK == 32)
        scores32<NI>(qi, D, KT, acc);
    else
        scores16<NI>(qi, D, KT, acc);
}

// rows r0 .. r0+nr-1's scores of the NK (16 or 32) keys at j, packed in KT [D, NK], into S (score_keys)
template <int NK>
X512 static inline void score_block(const float* q, int64_t r0, int64_t nr, const float* KT, int64_t j,
                                    const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    const int64_t L8 = (L + 7) / 8 * 8;
    __m512 acc[8];
    for (int64_t i0 = 0; i0 < nr; i0 += 4) {
        const int64_t ni = nr - i0 < 4 ? nr - i0 : 4;
        const float* qi = q + (r0 + i0) * D;
        switch (ni) {
            case 4: scores_nk<NK, 4>(qi, D, KT, acc); break;
            case 3: scores_nk<NK, 3>(qi, D, KT, acc); break;
            case 2: scores_nk<NK, 2>(qi, D, KT, acc); break;
            default: scores_nk<NK, 1>(qi, D, KT, acc);
        }
        for (int h = 0; h < NK / 16; h++)
            store_scores16(acc + 4 * h, ni, r0 + i0, j + 16 * h, mask, Q, L, scale, S + i0 * L8, L8);
    }
}

// score_keys (the same arguments and bits), 32 keys at a time, then 16 (a last 8 through score_keys)
template <class T>
X512 static void score_keys_512(const float* q, int64_t r0, int64_t nr, const T* const* kptr, int64_t j0,
                                int64_t j1, const float* mask, int64_t Q, int64_t L, int64_t D, float scale, float* S) {
    alignas(64) float KT[32 * 256];  // head_dim <= 256 (checked by the caller: fused.py)
    prefetch_rows(kptr, j0, KV_PREFETCH, L, D * sizeof(T));
    int64_t j = j0;
    for (; j + 32 <= j1; j += 32) {
        for (int t = 0; t < 4; t++) pack8(kptr, j + 8 * t, L, D, KT + 8 * t, 32);
        score_block<32>(q, r0, nr, KT, j, mask, Q, L, D, scale, S);
    }
    for (; j + 16 <= j1; j += 16) {
        for (int t = 0; t < 2; t++) pack8(kptr, j + 8 * t, L, D, KT + 8 * t, 16);
        score_block<16>(q, r0, nr, KT, j, mask, Q, L, D, scale, S);
    }
    if (j < j1) score_keys(q, r0, nr, kptr, j, j1, mask, Q, L, D, scale, S);
}
