// The attention: each query row over its sequence's keys and values, one row at a time (scores:
// attention_scores.h, softmax: softmax.h, weighted sums: weighted_sums.h). paged_attention_2p (decode
// and verification widths: scores, softmax and weighted sums as three parallel phases) and
// paged_attention (one task per group of rows) read the paged KV cache in place through the block
// table, fp32 or fp16; attention_gathered (specd_attention) reads keys and values gathered by the
// caller. ISA: AVX2 + FMA, with the AVX512 scores and sums where att_avx512(). Relies on common.h
// (grow) and the three headers above; the fused layer (layer.h: write_and_attend) calls the paged two.
//
// Attention over gathered keys, one query row at a time: every row's result is computed by the same
// loop whatever the other rows are (torch's SDPA blocks query rows through GEMMs whose kernels, and
// so sum orders, change with the number of rows). Scores sum over D in a fixed order, the softmax
// and the weighted sum over keys run key by key in order; keys whose mask is -inf are skipped
// (adding exact zeros), so a row's keys padded out to a longer batch do not change it either.
#pragma once

#include "attention_scores.h"
#include "common.h"
#include "softmax.h"
#include "weighted_sums.h"

#define ATT_ROWS 16  // query rows per task (they share one pass over the keys)

// Rows r0 .. r0+nr-1 of one (sequence, KV head), their scores already in S [nr, L8] (L8 = L rounded
// up to 8; score_rows / score_keys): each row's softmax over its keys and its weighted sum of the
// values (V row j at vrow(j)) into out rows r0 .. r0+nr-1, the same computation whichever rows share
// the call.
template <class VRow>
static void attn_finish(int64_t r0, int64_t nr, VRow vrow, int64_t L, int64_t D, float* S, float* out) {
    float inv[ATT_ROWS];
    float* outp[ATT_ROWS];
    softmax_rows(S, nr, L, inv);
    for (int64_t i = 0; i < nr; i++) outp[i] = out + (r0 + i) * D;
    weighted_sums(nr, S, L, vrow, D, inv, outp);
}

// key and value rows of (sequence b, KV head h) for positions 0 .. Lp-1, through the block table (a
// block at a time: a division per key cost ~3% of a one-row step at 900 tokens)
template <class E>
static inline void kv_rows(const E* kv, const E* vbase, int64_t b, int64_t h, int64_t KVH, int64_t D,
                           const int32_t* bt, int64_t maxb, int64_t BS, int64_t Lp, const E** kp, const E** vp) {
    const int64_t step = KVH * D;  // one slot to the next within a block
    for (int64_t j0 = 0, blk = 0; j0 < Lp; j0 += BS, blk++) {
        const int64_t off = ((int64_t)bt[b * maxb + blk] * BS * KVH + h) * D, n = Lp - j0 < BS ? Lp - j0 : BS;
        const E *k0 = kv + off, *v0 = vbase + off;
        for (int64_t i = 0; i < n; i++) kp[j0 + i] = k0 + i * step, vp[j0 + i] = v0 + i * step;
    }
}

// The same attention in two parallel phases, for decode and verification widths (all scores fit in
// ATT2_MAX_BYTES): (1) scores of every row of a (sequence, KV head) for one chunk of ATT2_CHUNK keys
// per task (each score is its own lane's sum, so who computes which keys changes no bit), (2) the
// rows' softmax, SUM_ROWS rows per task, (3) the weighted sums per 32-column slice of the values and
// group of rows (each element its own chain over keys in order), as attn_finish computes them. Balances the
// work over threads where one task per (sequence, KV head) could not (batch 1: 3 KV heads for 2
// threads), and a decode row's 3 query heads read each value slice once. Head sizes that are not a
// multiple of 32 take the one-phase kernel.
#define ATT2_CHUNK 256
#define ATT2_MAX_BYTES (16 << 20)  // SPECD_ATT2_MAX_BYTES overrides (0: always the one-phase kernel)

static double att2_max_bytes() {
    const char* e = getenv("SPECD_ATT2_MAX_BYTES");
    return e ? atof(e) : (double)ATT2_MAX_BYTES;
}

// Whether a call's attention is worth a second thread: its work, keys x (rows + 8) per sequence and
// KV head (the 8: a key's fixed cost, its fetch and pack, in rows' worth), against ATT_PAR_WORK.
// Below it one thread runs the same tasks: on a 2-core Xeon (eval/att_rows.cpp with COLD=1, the
// cache out of L2 as in a step; 30 layers) one thread saved the phases' barriers at 8 cached tokens
// (1 row 0.28-0.32 -> 0.18-0.21 ms per step, 4 rows 0.39-0.43 -> 0.28-0.30) and at 64 tokens and
// one row (0.42-0.45 -> 0.38-0.40), and lost from 128 tokens (two threads fetch the keys faster).
// Who runs a task changes no bit.
#define ATT_PAR_WORK 3000  // SPECD_ATT_PAR_WORK overrides (0: always parallel)

static bool att_parallel(const int32_t* qsl, int64_t B, int64_t G, int64_t KVH, int64_t Lp) {
    const char* e = getenv("SPECD_ATT_PAR_WORK");
    const double limit = e ? atof(e) : (double)ATT_PAR_WORK;
    double work = 0;
    for (int64_t b = 0; b < B; b++) work += (double)KVH * Lp * (G * (qsl[b + 1] - qsl[b]) + 8);
    return work >= limit;
}

template <class E>
static bool paged_attention_2p(const float* qkv, int64_t stride, int64_t H, int64_t KVH, int64_t D, const E* kv,
                               int64_t nslots, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                               int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, float* o) {
    const int64_t G = H / KVH, L8 = (Lp + 7) / 8 * 8, T = qsl[B] - qsl[0];
    if (D % WS_COLS || (double)G * KVH * T * L8 * sizeof(float) > att2_max_bytes()) return false;
    const int64_t mr = ws_max_rows(), ngm = (G * Qm + mr - 1) / mr;  // row groups per (sequence, KV head), at most
    const E* vbase = kv + nslots * KVH * D;
    // scratch of the calling thread, kept between calls (grown, never cleared: every element read is
    // written first; allocating and zeroing it per layer cost 4-7% of a step: page faults on fresh
    // mmap'd memory); the threads use it through the pointers. Per (b, h): its rows (g * q + i) from
    // row base(b, h) of S and QG, its keys' and values' rows in KP and VP.
    static thread_local std::vector<float> s_buf, qg_buf, inv_buf;
    grow(s_buf, G * KVH * T * L8), grow(qg_buf, G * KVH * T * D), grow(inv_buf, G * KVH * T);
    float *const S = s_buf.data(), *const QG = qg_buf.data(), *const INV = inv_buf.data();
    static thread_local std::vector<const E*> kp_buf, vp_buf;
    if ((int64_t)kp_buf.size() < B * KVH * Lp) kp_buf.resize(B * KVH * Lp), vp_buf.resize(B * KVH * Lp);
    const E** const KP = kp_buf.data();
    const E** const VP = vp_buf.data();
    const int64_t nch = (L8 + ATT2_CHUNK - 1) / ATT2_CHUNK;
    auto base = [&](int64_t b, int64_t h) { return (h * T + (qsl[b] - qsl[0])) * G; };
#pragma omp parallel if (att_parallel(qsl, B, G, KVH, Lp))
    {
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++) {
                const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b];
                float* qg = QG + base(b, h) * D;
                for (int64_t g = 0; g < G; g++)
                    for (int64_t i = 0; i < q; i++)
                        memcpy(qg + (g * q + i) * D, qkv + (t0 + i) * stride + (h * G + g) * D, D * sizeof(float));
                kv_rows(kv, vbase, b, h, KVH, D, bt, maxb, BS, Lp, KP + (b * KVH + h) * Lp,
                        VP + (b * KVH + h) * Lp);
            }
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t c = 0; c < nch; c++) {
                    const int64_t q = qsl[b + 1] - qsl[b], R = G * q, j0 = c * ATT2_CHUNK;
                    const int64_t j1 = j0 + ATT2_CHUNK < L8 ? j0 + ATT2_CHUNK : L8;
                    if (R > 0)
                        (att_avx512() ? score_keys_512<E> : score_keys<E>)(QG + base(b, h) * D, 0, R, KP + (b * KVH + h) * Lp, j0, j1,
                                   bias + b * Qm * Lp, q, Lp, D, scale, S + base(b, h) * L8);
                }
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t r0 = 0; r0 < G * Qm; r0 += SUM_ROWS) {
                    const int64_t R = G * (qsl[b + 1] - qsl[b]);
                    if (r0 < R)
                        softmax_rows(S + (base(b, h) + r0) * L8, R - r0 < SUM_ROWS ? R - r0 : SUM_ROWS, Lp,
                                     INV + base(b, h) + r0);
                }
#pragma omp for schedule(dynamic) collapse(4)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t c0 = 0; c0 < D; c0 += WS_COLS)
                    for (int64_t k = 0; k < ngm; k++) {
                        const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b], R = G * q;
                        const int64_t ng = (R + mr - 1) / mr, n = ng ? (R + ng - 1) / ng : 0, r0 = k * n;
                        if (r0 >= R) continue;
                        float* outp[WS_MAX_ROWS_512];
                        const int64_t nk = R - r0 < n ? R - r0 : n;
                        for (int64_t i = 0; i < nk; i++) {
                            const int64_t r = r0 + i, g = r / q;
                            outp[i] = o + (t0 + r % q) * H * D + (h * G + g) * D;
                        }
                        const E* const* vp = VP + (b * KVH + h) * Lp;
                        wsum_rows(nk, S + (base(b, h) + r0) * L8, L8, Lp, [vp](int64_t j) { return vp[j]; },
                                  c0, INV + base(b, h) + r0, outp);
                    }
    }
    return true;
}

// Attention of every query of every sequence over the paged cache, each (sequence, KV head) with the
// same scores, softmax and weighted sums as specd_attention (bit for bit), reading keys and values
// in place through the block table: one pointer per key, keys transposed 8 at a time in L1 (a packed
// copy of the whole context per layer cost more than the attention itself at 2k tokens).
//   qkv [T, stride] (q heads first), kv [2, nslots, KVH, D], bias [B, Qm, Lp] additive, o [T, H * D]
template <class E>
static void paged_attention(const float* qkv, int64_t stride, int64_t H, int64_t KVH, int64_t D, const E* kv,
                            int64_t nslots, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                            int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, float* o) {
    const int64_t G = H / KVH, L8 = (Lp + 7) / 8 * 8;
    const int64_t nrg = (G * Qm + ATT_ROWS - 1) / ATT_ROWS;  // row groups per (sequence, KV head), at most
    const E* vbase = kv + nslots * KVH * D;
#pragma omp parallel if (att_parallel(qsl, B, G, KVH, Lp))
    {
        // per-thread scratch kept between calls (grown, never cleared: every element read is written first)
        static thread_local std::vector<float> S, QG, OUT;
        static thread_local std::vector<const E*> KP, VP;
        grow(S, ATT_ROWS * L8), grow(QG, G * Qm * D), grow(OUT, G * Qm * D);
        if ((int64_t)KP.size() < Lp) KP.resize(Lp), VP.resize(Lp);
        int64_t have = -1;  // the (sequence, KV head) whose key and value rows KP / VP hold in this call
        // one task per group of ATT_ROWS rows of a (sequence, KV head): a prefill chunk of one
        // sequence has 3 KV heads for 2 threads, so one task per head left a thread idle a third of
        // the time; row r of (b, h) is query r % q of head h * G + r / q
#pragma omp for schedule(dynamic) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++)
                for (int64_t k = 0; k < nrg; k++) {
                    const int64_t t0 = qsl[b], q = qsl[b + 1] - qsl[b], R = G * q, r0 = k * ATT_ROWS;
                    if (r0 >= R) continue;
                    const int64_t nr = R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS;
                    if (have != b * KVH + h) {
                        kv_rows(kv, vbase, b, h, KVH, D, bt, maxb, BS, Lp, KP.data(), VP.data());
                        have = b * KVH + h;
                    }
                    const E* const* vp = VP.data();
                    for (int64_t r = r0; r < r0 + nr; r++)
                        memcpy(QG.data() + r * D, qkv + (t0 + r % q) * stride + (h * G + r / q) * D, D * sizeof(float));
                    (att_avx512() ? score_keys_512<E> : score_keys<E>)(QG.data(), r0, nr, KP.data(), 0, L8,
                                                                     bias + b * Qm * Lp, q, Lp, D, scale, S.data());
                    attn_finish(r0, nr, [vp](int64_t j) { return vp[j]; }, Lp, D, S.data(), OUT.data());
                    for (int64_t r = r0; r < r0 + nr; r++)
                        memcpy(o + (t0 + r % q) * H * D + (h * G + r / q) * D, OUT.data() + r * D, D * sizeof(float));
                }
    }
}

// Attention over keys and values gathered by the caller (specd_attention, the CPU attention backend
// of an op-by-op forward):
//   q    [B, KVH, R, D]  query rows grouped under their KV head (row r uses mask row r % Q)
//   kv   [2, B, L, KVH, D] keys then values
//   mask [B, Q, L] additive (0 or -inf)
//   out  [B, KVH, R, D]
static void attention_gathered(const float* q, const float* kv, const float* mask, int64_t B, int64_t KVH, int64_t R,
                               int64_t Q, int64_t L, int64_t D, float scale, float* out) {
    const float* kbase = kv;
    const float* vbase = kv + B * L * KVH * D;
    const int64_t L8 = (L + 7) / 8 * 8;
#pragma omp parallel
    {
        float* S = new float[ATT_ROWS * (L8 > 0 ? L8 : 8)];
        float* KT = new float[D * (L8 > 0 ? L8 : 8)];
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < KVH; h++) {
                pack_kt(kbase + (b * L * KVH + h) * D, L, KVH, D, KT);
                for (int64_t r0 = 0; r0 < R; r0 += ATT_ROWS) {
                    const int64_t nr = R - r0 < ATT_ROWS ? R - r0 : ATT_ROWS;
                    const float* vb = vbase + (b * L * KVH + h) * D;
                    score_rows(q + (b * KVH + h) * R * D, r0, nr, KT, mask + b * Q * L, Q, L, D, scale, S);
                    attn_finish(r0, nr, [vb, KVH, D](int64_t j) { return vb + j * KVH * D; }, L, D, S,
                                out + (b * KVH + h) * R * D);
                }
            }
        delete[] S;
        delete[] KT;
    }
}
