// specd's CPU kernel for x86-64 with AVX2 + FMA + F16C (specd/model/qkernel.py compiles this file, the
// one translation unit, with g++ -O3 -mavx2 -mfma -mf16c -fopenmp and loads it with ctypes; AVX512 and
// AMX functions carry their own target attributes and run where the CPU has them). Its C API:
//   specd_qgemm_i8 / specd_qgemm_i4  fp32-activation weight-only GEMMs (gemm_f32.h)
//   specd_qgemm_x8                   int8-activation GEMM (quantize.h, gemm_x8*.h: AVX2, AVX512-VNNI, AMX;
//                                    gemm_kq.h: GGUF's K-quants as they are)
//   specd_x8_isa                     the instruction set those and the attention use (common.h)
//   specd_pack_x8_gguf               GGUF Q4_0 / Q4_1 / Q8_0 rows into the x8 layout (a load's repacking)
//   specd_pack_kq_gguf               GGUF Q4_K / Q5_K / Q6_K / Q8_0 rows into the kq layout (kq_pack.h)
//   specd_kq_rows                    fp32 rows of a kq-layout weight (an embedding's lookup; kq_pack.h)
//   specd_attention                  attention over gathered keys (attention*.h, softmax.h, weighted_sums.h)
//   specd_head_layer / specd_layers  whole decoder layers: norms, RoPE, SiLU, KV writes, paged attention
//                                    (layer.h)
//   specd_apply_bitmask              grammar masks on logit rows (bitmask.h)
// Every output row is computed by the same operations in the same order whatever the other rows of
// the call are (and whichever instruction set runs), so a row's bits depend on that row alone:
// speculative verification stays lossless. Each header says what it does and what it relies on.
#include "common.h"
#include "gemm_f32.h"
#include "quantize.h"
#include "gemm_x8_avx2.h"
#include "gemm_x8_avx512.h"
#include "gemm_x8_amx.h"
#include "gemm_x8.h"
#include "gemm_kq.h"
#include "kq_pack.h"
#include "attention_scores.h"
#include "softmax.h"
#include "weighted_sums.h"
#include "attention.h"
#include "layer.h"
#include "bitmask.h"

extern "C" {
// Forbidden logits := -inf: logits rows row_idx[0..rows) (row stride ld, V columns) under bitmask
// rows [rows, W] (bitmask.h).
void specd_apply_bitmask(float* logits, int64_t ld, const int64_t* row_idx, int64_t rows, int64_t V,
                         const int32_t* bitmask, int64_t W) {
    apply_bitmask_rows(logits, ld, row_idx, rows, V, bitmask, W);
}

// The int8-activation GEMM's instruction set: want 2 (AMX, where the CPU has it, else the best below),
// 1 (AVX512-VNNI, where the CPU has it), 0 (AVX2), -1 (the CPU decides), 9 (no change); returns the
// one in use (2, 1 or 0). All give bitwise-equal results.
int specd_x8_isa(int want) {
    if (want < 0) g_x8_isa = -1;
    else if (want == 2) g_x8_isa = cpu_amx() ? 2 : cpu_avx512_vnni() ? 1 : 0;
    else if (want == 1) g_x8_isa = cpu_avx512_vnni() ? 1 : 0;
    else if (want == 0) g_x8_isa = 0;
    return x8_isa();
}

// y = x @ W^T (+ add[M,N]) (+ bias[N]); add/bias may be NULL; add may alias y.
void specd_qgemm_i8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N,
                    int64_t G, const float* add, const float* bias, float* y) {
    gemm<false>(x, M, K, q, scale, nullptr, N, G, add, bias, y, nullptr);
}

// xsum [M, K/G]: per-group sums of x (the caller's scratch; filled here when mins is not NULL)
void specd_qgemm_i4(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale, const float* mins,
                    int64_t N, int64_t G, const float* add, const float* bias, float* y, float* xsum) {
    if (mins) group_sums(x, M, K, G, xsum);
    gemm<true>(x, M, K, q, scale, mins, N, G, add, bias, y, xsum);
}

// The interleaved layout (see gemm_x8_avx2.h): w, scale [, mins] packed by the caller (quant.pack_x8); fmt:
// X8_INT4 (int4 codes, else int8) | X8_HALF (scale and mins are halves, else fp32) | X8_OFF8 (int4: the
// mins are -8 x the scales, mins unused); or X8_KQ alone:
// w the kq layout's tiles, scale their table (gemm_kq.h).
void specd_qgemm_x8(const float* x, int64_t M, int64_t K, const uint8_t* w, const void* scale, const void* mins,
                    int64_t N, int fmt, const float* add, const float* bias, float* y) {
    const Lin L{2 + fmt, N, K, 32, K, w, scale, mins, bias};
    std::vector<float> fs, xp;
    std::vector<int8_t> qs;
    lin(L, x, M, add, y, fs, qs, xp);
}

// One decoder layer (see Lin in layer.h), x [T, d] updated in place: x += o(attn(rope(qkv(norm(x)))));
// x += down(silu(gate) * up(norm(x))). lins: qkv, o, gate_up, down. The new K, V go to slot_mapping.
void specd_head_layer(float* x, const float* e, const float* w_e, int64_t T, int64_t d, const float* w_in,
                      const float* w_post, float eps, const Lin* lins, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                      const float* cos, const float* sin, const int64_t* pos, void* kv, int64_t nslots,
                      const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                      int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16);

// Every decoder layer of a model in one call (specd_head_layer without e, nl times; the per-layer
// Python and ctypes calls cost ~0.2 ms of a 3-4 ms one-row forward): layer i's projections lins[4i .. 4i+3], norm
// weights w_in[i] and w_post[i], cache kv + i * kv_layer bytes; caps[i], where not null, gets a copy
// of x [T, d] as it enters layer i (a feature head's features).
void specd_layers(float* x, int64_t nl, const Lin* lins, const float* const* w_in, const float* const* w_post,
                  float* const* caps, int64_t T, int64_t d, float eps, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                  const float* cos, const float* sin, const int64_t* pos, char* kv, int64_t kv_layer, int64_t nslots,
                  const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                  int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16) {
    for (int64_t i = 0; i < nl; i++) {
        if (caps[i]) memcpy(caps[i], x, T * d * sizeof(float));
        specd_head_layer(x, nullptr, nullptr, T, d, w_in[i], w_post[i], eps, lins + 4 * i, H, KVH, D, inter, cos, sin,
                         pos, kv + i * kv_layer, nslots, slot_mapping, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, kv16);
    }
}

// One decoder layer (as above), or with e != nullptr a feature head's (specd/model/head.py): its
// q/k/v projection reads [rms(e) * w_e, rms(x) * w_in] (2d wide per row) instead of rms(x) * w_in.
void specd_head_layer(float* x, const float* e, const float* w_e, int64_t T, int64_t d, const float* w_in,
                      const float* w_post, float eps, const Lin* lins, int64_t H, int64_t KVH, int64_t D, int64_t inter,
                      const float* cos, const float* sin, const int64_t* pos, void* kv, int64_t nslots,
                      const int64_t* slot_mapping, const int32_t* qsl, int64_t B, const int32_t* bt, int64_t maxb,
                      int64_t BS, const float* bias, int64_t Qm, int64_t Lp, float scale, int64_t kv16) {
    decoder_layer(x, e, w_e, T, d, w_in, w_post, eps, lins, H, KVH, D, inter, cos, sin, pos, kv, nslots,
                  slot_mapping, qsl, B, bt, maxb, BS, bias, Qm, Lp, scale, kv16);
}

// GGUF Q4_0 / Q4_1 / Q8_0 rows (kind 0 / 1 / 2: blocks of 18 / 20 / 34 bytes per 32 weights, raw as in the
// file) into the x8 layout (gemm_x8_avx2.h), as quant.pack_x8 lays them out: each block's 16 / 32 code
// bytes move as 4-byte words (the int4 layout's vector v byte 4c + i is the packed row's byte 4v + i),
// its fp16 d (and Q4_1's m) into scale / mins [tiles, K/32, 8] as the same halves; nothing is rounded.
// rows[i] is the file row of output row o0 + i; w, scale, mins are the whole projection's buffers (the
// loader zeroes the last tile's padding rows). A load's repacking: data movement at memory speed, where
// the torch permutes cost ~10 s for a 1.7B Q4_0 file.
void specd_pack_x8_gguf(const uint8_t* raw, int64_t kind, int64_t K, const int64_t* rows, int64_t n, int64_t o0,
                        uint8_t* w, uint16_t* scale, uint16_t* mins) {
    const int64_t nbk = K / 32, bsz = kind == 0 ? 18 : kind == 1 ? 20 : 34, words = kind == 2 ? 8 : 4;
    const int64_t hdr = kind == 1 ? 4 : 2;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t* src = raw + rows[i] * nbk * bsz;
        const int64_t o = o0 + i, t = o / 8, c = o % 8;
        for (int64_t b = 0; b < nbk; b++) {
            const uint8_t* blk = src + b * bsz;
            uint8_t* dst = w + (t * nbk + b) * words * 32 + 4 * c;
            for (int64_t s = 0; s < words; s++) memcpy(dst + 32 * s, blk + hdr + 4 * s, 4);
            memcpy(scale + (t * nbk + b) * 8 + c, blk, 2);
            if (kind == 1) memcpy(mins + (t * nbk + b) * 8 + c, blk + 2, 2);
        }
    }
}

// GGUF Q4_K / Q5_K / Q6_K / Q8_0 rows (kind 0 / 1 / 2 / 3: the file's blocks of 144 / 176 / 210 bytes per
// 256 weights, 34 per 32) into (n + 7) / 8 tiles of the kq layout at out (gemm_kq.h), byte for byte
// quant.pack_kq of quant_load.kq_fields (kq_pack.h); rows[i] is the file row of output row i; the last
// tile's padding rows are written as zeros.
void specd_pack_kq_gguf(const uint8_t* raw, int64_t kind, int64_t K, const int64_t* rows, int64_t n, uint8_t* out) {
    pack_kq_gguf(raw, kind, K, rows, n, out);
}

// fp32 rows ids[0 .. n) of a kq-layout weight (w, its tile table, K columns) into out [n, K]:
// quant.KQFields.dequantize's bits
void specd_kq_rows(const uint8_t* w, const int64_t* tiles, int64_t K, const int64_t* ids, int64_t n, float* out) {
    kq_rows(w, tiles, K, ids, n, out);
}

void specd_attention(const float* q, const float* kv, const float* mask, int64_t B, int64_t KVH, int64_t R,
                     int64_t Q, int64_t L, int64_t D, float scale, float* out) {
    attention_gathered(q, kv, mask, B, KVH, R, Q, L, D, scale, out);
}
}
