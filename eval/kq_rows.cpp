// The CPU kernel's K-quant GEMM (gemm_kq, the "kq" layout) alone, over SmolLM2-1.7B-shaped layers (random
// bytes; qkv 2048->6144, o 2048->2048, gate_up 2048->16384, down 8192->2048), median of REPS passes, for M
// rows of activations: the weight bytes read per second, to set against the machine's read bandwidth (from
// memory: 24 layers, ~0.9-1.3 GB) and against the same bytes hot in the caches (NL=1 and the o projection
// only, 2.4-3.3 MB, ~L2/L3): where the one-row K-quant tile is bound by its instructions, not by memory.
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -std=c++17 -o /tmp/kq_rows eval/kq_rows.cpp
//   OMP_NUM_THREADS=1 [KIND=0] [NL=24] [HOT=1] [ISA=1] taskset -c 0 /tmp/kq_rows ROWS...
//
// KIND: 0 Q4_K, 1 Q5_K, 2 Q6_K, 3 Q8_0 (every tile); ISA: 1 AVX512-VNNI, 0 AVX2 (specd_x8_isa). Each pass
// also reads the same weights with a plain sum (32-byte loads, 4 accumulators, on the same threads) right after
// the GEMMs, so the GEMMs' rate is set against a read in the same moment of a machine whose bandwidth drifts.
#include "../specd/model/cpu_kernel/kernel.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

struct KW { int64_t K, N; std::vector<uint8_t> w; std::vector<int64_t> tiles; };

// every byte of every weight read once (the threads take contiguous halves, as the GEMMs' tiles)
static int64_t plain_read(const std::vector<KW>& ws) {
    int64_t total = 0;
    for (auto& w : ws) {
        const int64_t n = (int64_t)w.w.size() / 128;
        const uint8_t* p = w.w.data();
#pragma omp parallel for schedule(static) reduction(+ : total)
        for (int64_t i = 0; i < n; i++) {
            const __m256i* q = (const __m256i*)(p + 128 * i);
            const __m256i a = _mm256_add_epi8(_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1));
            const __m256i b = _mm256_add_epi8(_mm256_loadu_si256(q + 2), _mm256_loadu_si256(q + 3));
            total += _mm256_extract_epi8(_mm256_xor_si256(a, b), 0);
        }
    }
    return total;
}

static KW make(int64_t K, int64_t N, int kind, std::mt19937& g) {
    KW x{K, N, {}, {}};
    const int64_t NT = (N + 7) / 8, tb = kind == KQ_Q8 ? (K / 32) * kq_block_bytes(KQ_Q8) : (K / 256) * kq_sb_bytes(kind);
    x.w.resize(NT * tb);
    for (auto& b : x.w) b = (uint8_t)g();
    if (kind != KQ_Q8)  // sane super-block d / dmin halves (~0.01): no infinities in the sums
        for (int64_t t = 0; t < NT; t++)
            for (int64_t s = 0; s < K / 256; s++)
                for (int i = 0; i < 16; i++) memcpy(&x.w[t * tb + s * kq_sb_bytes(kind) + 2 * i], "\x1f\x21", 2);
    else
        for (int64_t o = 256; o < (int64_t)x.w.size(); o += kq_block_bytes(KQ_Q8))
            for (int i = 0; i < 8; i++) memcpy(&x.w[o + 2 * i], "\x1f\x21", 2);
    for (int64_t t = 0; t < NT; t++) x.tiles.push_back((t * tb) << 2 | kind);
    return x;
}

int main(int argc, char** argv) {
    const int kind = getenv("KIND") ? atoi(getenv("KIND")) : 0, isa = getenv("ISA") ? atoi(getenv("ISA")) : 1;
    const bool hot = getenv("HOT") && atoi(getenv("HOT"));
    const int NL = hot ? 1 : getenv("NL") ? atoi(getenv("NL")) : 24, reps = getenv("REPS") ? atoi(getenv("REPS")) : 15;
    std::mt19937 g(1);
    std::vector<KW> ws;
    const int64_t shapes[4][2] = {{2048, 6144}, {2048, 2048}, {2048, 16384}, {8192, 2048}};
    for (int l = 0; l < NL; l++)
        for (int i = hot ? 1 : 0; i < (hot ? 2 : 4); i++) ws.push_back(make(shapes[i][0], shapes[i][1], kind, g));
    double bytes = 0;
    for (auto& w : ws) bytes += (double)w.w.size();
    specd_x8_isa(isa);
    for (int ai = 1; ai < argc; ai++) {
        const int64_t M = atoi(argv[ai]), Kmax = 8192;
        std::vector<float> x(M * Kmax), y(M * 16384), dx(M * Kmax / 32), xsf(M * Kmax / 32);
        std::vector<int8_t> qx(M * Kmax);
        std::vector<int32_t> xs(M * Kmax / 16);
        for (auto& v : x) v = (g() % 1000) / 500.0f - 1;
        std::vector<double> ts, rs;
        const int inner = hot ? 200 : 1;
        int64_t chk = 0;
        for (int rep = 0; rep < reps; rep++) {
            auto t0 = std::chrono::steady_clock::now();
            for (int it = 0; it < inner; it++) chk += plain_read(ws);
            rs.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / inner);
            t0 = std::chrono::steady_clock::now();
            for (int it = 0; it < inner; it++)
                for (auto& w : ws) {
                    quantize_q8(x.data(), M, w.K, qx.data(), dx.data());
                    code_sums(qx.data(), dx.data(), M, w.K, xs.data(), xsf.data());
                    gemm_kq(qx.data(), dx.data(), xs.data(), xsf.data(), M, w.K, w.w.data(), w.tiles.data(), w.N, nullptr,
                            nullptr, y.data());
                }
            ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / inner);
        }
        std::sort(ts.begin(), ts.end()), std::sort(rs.begin(), rs.end());
        const double ms = ts[ts.size() / 2], rms = rs[rs.size() / 2];
        printf("kind %d isa %d %s M %ld: %.3f ms, %.2f GB/s of weights (%.1f MB); plain read %.2f GB/s; GEMMs at %.2f of "
               "it (%d)\n", kind, isa, hot ? "hot" : "memory", (long)M, ms, bytes / ms / 1e6, bytes / 1e6, bytes / rms / 1e6,
               rms / ms, (int)(chk & 1));
    }
}
