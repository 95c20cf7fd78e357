// What every part of the CPU kernel shares (specd/model/cpu_kernel/: headers included once, in order,
// by kernel.cpp, the one translation unit that qkernel.py compiles with AVX2 + FMA + F16C flags):
// the system headers, the fp16 element type and the loads that widen it exactly (ld8, ld1, ld16), a
// horizontal sum (hsum8), the AVX512 functions' own target attribute (X512), the run-time choice of
// instruction set that the int8-activation GEMMs and the paged attention follow (x8_isa, att_avx512;
// env switches SPECD_QGEMM_AVX512=0, SPECD_QGEMM_AMX=0), the K/V rows' prefetch distance, the
// row-parallel loop of the row-wise steps (for_rows) and a scratch helper (grow).
// ISA: AVX2 + FMA + F16C; X512 functions AVX512F/BW/DQ/VNNI. Relies on no other file here.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <vector>

// IEEE half (the bits torch.float16 stores): K/V cache elements, and the x8 layout's block scales and
// mins where they are halves exactly (GGUF stores Q4_0 / Q4_1 / Q8_0 ones so); widened to fp32 exactly
// on load (F16C), so every computation after the load is the same as from fp32 copies, bit for bit.
typedef uint16_t half_t;
static inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 ld8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// The attribute of the functions that run AVX512 (the unit itself is compiled for AVX2 only; the
// run-time choice below decides whether they are called)
#define X512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vnni")))

// K/V cache elements: fp32, or fp16 (half_t, see the top), widened to fp32 exactly on load (F16C),
// so every computation after the load is the fp32 cache's.
static inline float ld1(const float* p) { return *p; }
static inline float ld1(const half_t* p) { return _cvtsh_ss(*p); }
X512 static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
X512 static inline __m512 ld16(const half_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }

// Keys ahead whose key / value rows are prefetched: the paged cache's rows (one head's 256 bytes of
// every 768 at SmolLM2's 3 KV heads, a new block every 16 keys) defeat the hardware prefetcher, and
// at batch 16 x 150 tokens the cache read per step is as large as the weights'.
#define KV_PREFETCH 16

// 2: AMX (int8 tiles) for calls of AMX_MIN_ROWS rows or more, the AVX512-VNNI path below that;
// 1: the AVX512-VNNI path; 0: AVX2; -1 (start): the CPU decides (SPECD_QGEMM_AVX512=0 forces AVX2,
// SPECD_QGEMM_AMX=0 stops at AVX512-VNNI).
static int g_x8_isa = -1;

static bool env_off(const char* name) {
    const char* env = getenv(name);
    return env && strcmp(env, "0") == 0;
}

static bool cpu_avx512_vnni() {
    return !env_off("SPECD_QGEMM_AVX512") && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
}

// AMX needs the CPU's tiles and the kernel's leave to use their state (Linux: arch_prctl, once per process)
static bool cpu_amx() {
    unsigned a, b, c, d;
    if (env_off("SPECD_QGEMM_AMX") || !cpu_avx512_vnni() || !__get_cpuid_count(7, 0, &a, &b, &c, &d) ||
        !(d & (1u << 24)) || !(d & (1u << 25)))  // AMX-TILE, AMX-INT8
        return false;
    static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

static int x8_isa() {
    if (g_x8_isa < 0) g_x8_isa = cpu_amx() ? 2 : cpu_avx512_vnni() ? 1 : 0;
    return g_x8_isa;
}

// the paged attention's scores, softmax and weighted sums on AVX512 (attention_scores.h, softmax.h,
// weighted_sums.h) where the kernel's instruction set is AVX512-VNNI or AMX
static bool att_avx512() { return x8_isa() >= 1; }

// f(0) .. f(T-1), on every thread from ROWS_PAR rows (a layer's row-wise steps: norms, RoPE, SiLU, KV
// writes, group sums; each row its own computation, so the same bits), else on this one (an OpenMP
// region costs more than a few rows)
#define ROWS_PAR 32
template <class F>
static inline void for_rows(int64_t T, F f) {
    if (T >= ROWS_PAR) {
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) f(t);
    } else {
        for (int64_t t = 0; t < T; t++) f(t);
    }
}

static inline void grow(std::vector<float>& v, size_t n) {
    if (v.size() < n) v.resize(n);
}
