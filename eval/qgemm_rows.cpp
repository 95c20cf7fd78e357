// The CPU kernel's int8-activation GEMMs alone, over the int4 linears of SmolLM2-135M's 30 layers
// (random codes; qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576), median of 60 passes,
// for W rows of activations: where a decode step's and a verification's GEMM time goes, without
// Python, attention or the LM head (docs/benchmarks.md, session 18).
//
//   g++ -O3 -mavx2 -mfma -mf16c -fopenmp -std=c++17 -o /tmp/qgemm_rows eval/qgemm_rows.cpp
//   OMP_NUM_THREADS=2 [HALF=1] [NL=1] /tmp/qgemm_rows ISA ROWS...
//
// ISA: 2 AMX (from 7 rows; AVX512-VNNI below), 1 AVX512-VNNI, 0 AVX2 (specd_x8_isa). HALF=1: fp16
// block scales and mins (as GGUF's), else fp32. NL=1: one layer's weights run 30 times (they stay in
// L2) instead of 30 layers streamed from L3/memory.
#include "../specd/model/cpu_kernel/kernel.cpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

struct W { int64_t K, N; std::vector<uint8_t> w; std::vector<float> s, m; std::vector<uint16_t> sh, mh; };
int main(int argc, char** argv) {
  int isa = atoi(argv[1]); bool half = getenv("HALF") && atoi(getenv("HALF"));
  int NL = getenv("NL") ? atoi(getenv("NL")) : 30;
  std::vector<W> ws; std::mt19937 g(1);
  int64_t shapes[4][2] = {{576,960},{576,576},{576,3072},{1536,576}};
  for (int l = 0; l < NL; l++) for (auto& sh: shapes) {
    W x; x.K = sh[0]; x.N = sh[1]; int64_t NT = (x.N + 7) / 8, nbk = x.K / 32;
    x.w.resize(NT * nbk * 128); for (auto& b: x.w) b = g();
    x.s.assign(NT * nbk * 8, 0.01f); x.m.assign(NT * nbk * 8, -0.05f);
    x.sh.assign(NT * nbk * 8, 0x211F); x.mh.assign(NT * nbk * 8, 0xAA66);  // ~0.01, ~-0.05 as halves
    ws.push_back(std::move(x));
  }
  specd_x8_isa(isa);
  for (int ai = 2; ai < argc; ai++) {
    int64_t M = atoi(argv[ai]);
    std::vector<float> x(M * 1536), y(M * 3072);
    for (auto& v: x) v = (g() % 1000) / 500.0f - 1;
    std::vector<double> ts;
    for (int rep = 0; rep < 60; rep++) {
      auto t0 = std::chrono::steady_clock::now();
      for (int rr = 0; rr < 30 / NL; rr++)
        for (auto& w: ws)
          specd_qgemm_x8(x.data(), M, w.K, w.w.data(), half ? (const void*)w.sh.data() : w.s.data(),
                         half ? (const void*)w.mh.data() : w.m.data(), w.N, 1 | (half ? 2 : 0), nullptr, nullptr, y.data());
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    printf("half %d layers %d M %ld: %.3f ms\n", (int)half, NL, (long)M, ts[ts.size() / 2]);
  }
}
