// `megamoe bench-gemm` — see gemm_cmd.h and docs/GEMM.md.
//
// Each case: the experts' grouped GEMM (FC1: N = 2I, K = H; FC2: N = H, K = I) with E local experts
// and T rows (tokens) per expert, on random finite operands generated on the GPU; cuBLASLt's dense
// fp8 GEMM (TN, bf16 out, per-tensor scaling) of the same M_total x N x K on the same buffers is the
// peer, timed in the same process. Timing: CUDA events around each launch, L2 flushed before every
// timed launch (--flush memset: a 256 MiB memset, as DeepGEMM's harness does, which leaves L2 full of
// dirty lines whose write-back the GEMM's loads pay for; --flush read: a 256 MiB read, which leaves it
// clean), median / min / max over --iters after --warmup launches; and, where libcupti can be opened,
// the same launches' kernel time from the GPU's timestamps (kernel_timer.h: what PyTorch's profiler
// and DeepGEMM's harness report; it leaves out the ~3 us of launch and teardown events include).
#include <CLI/CLI.hpp>
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "bench_harness.h"
#include "bench_model.h"
#include "commands.h"
#include "gemm_fill.h"
#include "kernels/gemm/gemm_weights.h"
#include "kernels/gemm/sm90_fp8_grouped_gemm.h"
#include "presets.h"

namespace megamoe::tool {
namespace {

using gemm::GemmDtype;
using gemm::GemmEpilogue;
using gemm::GroupedGemmArgs;
using gemm::GroupedLayout;


struct ModelShape {
  const char* name;
  int64_t hidden, intermediate;
  const char* experts;  // default --experts
  const char* tokens;   // default --tokens
};

const ModelShape kModels[] = {
    {"deepseek-v3", 7168, 2048, "32,128", "8,32,128,512,2048"},
    {"qwen3-30b-a3b", 2048, 768, "64", "8,32,256,1024"},
};

struct BenchOptions {
  std::string presets = "deepseek-v3,qwen3-30b-a3b";
  std::string experts;  // empty: the model's default list
  std::string tokens;   // empty: the model's default list
  int64_t hidden = 0, intermediate = 0;  // 0: the model's
  std::string fcs = "fc1,fc2";
  std::string layout = "auto";  // auto: masked at <= 32 tokens per expert, else contiguous
  bool swiglu = true;           // also time FC1 with the SwiGLU + fp8 requant epilogue
  bool cublas = true;
  int block_m = 0, block_n = 0, num_sms = 0, cluster = 0;
  int empty_every = 0;  // > 0: experts e with (e + 1) % empty_every == 0 get no rows
  std::string schedule = "auto";  // auto (the heuristic), dynamic (a global tile counter) or static (round-robin)
  std::string flush = "memset";      // memset (dirty L2) or read (clean L2) before each timed launch
  std::string weights_l2 = "normal";  // L2 policy of weight tiles read once: normal (the library default) or evict-first
  std::string probe = "none";  // none, stream, no-epilogue, no-loads, math-only: where the time goes
  std::string trace;                 // per-CTA timeline of one more launch per case, as JSON (empty: none)
  int iters = 20, warmup = 3;
  std::string json;
  // fp8-block (e4m3 + 128x128 scales), mxfp4 (the weights' image of gemm_weights.h: 16-, 32- and
  // 64-row tiles) or nvfp4 (its image: 16- and 32-row tiles, bf16 tokens, FC1 the scaled bf16 SwiGLU);
  // FP4: no cuBLASLt peer, wGB/s counts the FP4 bytes, E * N * K / 2
  std::string weight_format = "fp8-block";
  bool mxfp4() const { return weight_format == "mxfp4"; }
  bool nvfp4() const { return weight_format == "nvfp4"; }
  bool fp4() const { return mxfp4() || nvfp4(); }
  int fp4_math_wg = 0;  // mxfp4: math warpgroups per tile, 1 or 2 (0: the GEMM's default)
  int ctas_per_sm = 0;  // mxfp4: CTAs per SM of the 16-row tiles, 1 or 2 (0: the GEMM's default)
};

[[noreturn]] void fail(int code, const std::string& msg) { throw ToolError(code, msg); }

void cuda_check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) fail(kExitUnavailable, std::string(what) + ": " + cudaGetErrorString(e));
}

// cuBLASLt dense fp8 GEMM D[M, N] = X[M, K] * W[N, K]^T (bf16 out), row-major views.
struct CublasFp8 {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 64ull << 20;
  CublasFp8() {
    if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) fail(kExitUnavailable, "cublasLtCreate failed");
    cuda_check(cudaMalloc(&workspace, workspace_bytes), "cudaMalloc(cublas workspace)");
  }
  ~CublasFp8() {
    cudaFree(workspace);
    cublasLtDestroy(lt);
  }
  // Returns false when cuBLASLt has no algorithm for the shape.
  bool run(const void* x, const void* w, void* d, int64_t m, int64_t n, int64_t k, cudaStream_t s, bool* ok) {
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    const int8_t fast_accum = 1;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast_accum, sizeof(fast_accum));
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, k, n, k);  // W as column-major K x N
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, k, m, k);  // X as column-major K x M
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, n, m, n);     // D as column-major N x M
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                         sizeof(workspace_bytes));
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, lc, pref, 1, &res, &found);
    const float alpha = 1.f, beta = 0.f;
    bool good = found > 0;
    if (good)
      good = cublasLtMatmul(lt, op, &alpha, w, la, x, lb, &beta, d, lc, d, lc, &res.algo, workspace, workspace_bytes, s) ==
             CUBLAS_STATUS_SUCCESS;
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    *ok = good;
    return good;
  }
};

// One more flushed launch with the GEMM's timeline on (GroupedGemmArgs::trace): prints where its time
// went and appends the stamps to `json` (one object per case, µs from the first CTA's start).
constexpr int kTraceTiles = 1 << 16;

double pct(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, size_t(q * double(v.size() - 1) + 0.5))];
}

void trace_case(GroupedGemmArgs g, FlushMode flush, cudaStream_t s, double weight_bytes, const std::string& label,
                std::ostream* json) {
  int sms = 0, dev = 0;
  cuda_check(cudaGetDevice(&dev), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
  const int64_t header = int64_t(sms) * gemm::kTraceWordsHeader;
  const int64_t words = header + int64_t(kTraceTiles) * gemm::kTraceWordsPerTile;
  uint64_t* dtrace = nullptr;
  cuda_check(cudaMalloc(&dtrace, words * 8), "cudaMalloc(trace)");
  cuda_check(cudaMemset(dtrace, 0, words * 8), "cudaMemset(trace)");
  g.trace = dtrace;
  g.trace_max_tiles = kTraceTiles;
  if (const Status fst = flush_l2(Device::cuda(dev), s, flush); !fst) fail(kExitUnavailable, fst.message());
  gemm::GemmTileConfig used;
  const Status st = gemm::launch_grouped_gemm(g, s, &used);
  if (!st.is_ok()) fail(kExitUnavailable, st.to_string());
  cuda_check(cudaStreamSynchronize(s), "traced launch");
  std::vector<uint64_t> h(words);
  cuda_check(cudaMemcpy(h.data(), dtrace, words * 8, cudaMemcpyDeviceToHost), "copy trace");
  cudaFree(dtrace);
  uint64_t t0 = ~0ull;
  int ctas = 0;
  for (int c = 0; c < sms; ++c)
    if (h[c * gemm::kTraceWordsHeader] != 0) {
      t0 = std::min(t0, h[c * gemm::kTraceWordsHeader]);
      ctas = c + 1;
    }
  if (ctas == 0) return;
  auto us = [t0](uint64_t t) { return t == 0 ? 0.0 : double(t - t0) * 1e-3; };
  // each CTA's tiles in the order it ran them
  std::vector<std::vector<const uint64_t*>> tiles(ctas);
  for (int64_t t = 0; t < kTraceTiles; ++t) {
    const uint64_t* r = &h[header + t * gemm::kTraceWordsPerTile];
    if (r[0] >= 1 && r[0] <= uint64_t(ctas) && r[5] != 0) tiles[r[0] - 1].push_back(r);
  }
  std::vector<double> tables, first, done, kloop, epi, gap, ntiles;
  for (int c = 0; c < ctas; ++c) {
    const uint64_t* hd = &h[c * gemm::kTraceWordsHeader];
    tables.push_back(us(hd[1]));
    done.push_back(us(hd[3]));
    auto& v = tiles[c];
    std::sort(v.begin(), v.end(), [](const uint64_t* a, const uint64_t* b) { return a[3] < b[3]; });
    for (size_t j = 0; j < v.size(); ++j) {
      if (j == 0) first.push_back(us(v[j][3]));
      kloop.push_back(double(v[j][4] - v[j][3]) * 1e-3);
      epi.push_back(double(v[j][5] - v[j][4]) * 1e-3);
      if (j + 1 < v.size()) gap.push_back(double(v[j + 1][3] - v[j][5]) * 1e-3);
    }
    ntiles.push_back(double(v.size()));
  }
  const double span = pct(done, 0.5) - pct(first, 0.5);
  std::printf("  # trace %s (%s): %d CTAs, tiles/CTA %.0f-%.0f; µs from the first CTA's start: tables med %.2f, first "
              "data min/med/max %.2f/%.2f/%.2f, done min/med/max %.2f/%.2f/%.2f; per tile med (p90): K loop %.2f (%.2f), "
              "epilogue %.2f (%.2f), wait for the next %.2f (%.2f); weights over first data..done (medians) %.0f GB/s\n",
              label.c_str(), used.to_string().c_str(), ctas, pct(ntiles, 0), pct(ntiles, 1), pct(tables, 0.5),
              pct(first, 0), pct(first, 0.5), pct(first, 1), pct(done, 0), pct(done, 0.5), pct(done, 1),
              pct(kloop, 0.5), pct(kloop, 0.9), pct(epi, 0.5), pct(epi, 0.9), pct(gap, 0.5), pct(gap, 0.9),
              span > 0 ? weight_bytes / (span * 1e-6) / 1e9 : 0.0);
  if (json != nullptr) {
    *json << "{\"case\": \"" << label << "\", \"tiles\": \"" << used.to_string()
          << "\", \"tile_fields\": [\"id\", \"claimed\", \"issued\", \"first_data\", \"k_loop_done\", "
             "\"epilogue_done\"], \"ctas\": [";
    for (int c = 0; c < ctas; ++c) {
      const uint64_t* hd = &h[c * gemm::kTraceWordsHeader];
      *json << (c ? ",\n  " : "\n  ") << "{\"start\": " << us(hd[0]) << ", \"tables\": " << us(hd[1])
            << ", \"producer_done\": " << us(hd[2]) << ", \"math_done\": " << us(hd[3]) << ", \"tiles\": [";
      for (size_t j = 0; j < tiles[c].size(); ++j) {
        const uint64_t* r = tiles[c][j];
        *json << (j ? ", " : "") << "[" << (r - &h[header]) / gemm::kTraceWordsPerTile << ", " << us(r[1]) << ", "
              << us(r[2]) << ", " << us(r[3]) << ", " << us(r[4]) << ", " << us(r[5]) << "]";
      }
      *json << "]}";
    }
    *json << "]}";
  }
}

// One timed case: an FC of one model with E experts and T rows per expert, in one layout.
struct GemmCase {
  ModelShape model;
  std::string fc;  // fc1, fc1+swiglu, fc2
  GemmEpilogue epilogue = GemmEpilogue::kStoreBf16;
  int64_t experts = 0, tokens = 0, n = 0, k = 0;
  bool masked = false;
  int64_t busy = 0;  // experts with rows (--empty-every leaves the others idle)
  bool empty(int64_t e, int empty_every) const { return empty_every > 0 && (e + 1) % empty_every == 0; }
};

// Every case the flags ask for: per model, per --experts, per --tokens, the FCs in order.
std::vector<GemmCase> plan_gemm_cases(const BenchOptions& o) {
  if (o.fp4_math_wg != 0 && !o.mxfp4())
    fail(kExitUsage, "invalid value for --fp4-math-wg: " + std::to_string(o.fp4_math_wg) +
                         ", needs --weight-format mxfp4 (math warpgroups of the mxfp4 tiles; --weight-format is " +
                         o.weight_format + ")");
  if (o.ctas_per_sm != 0 && !o.mxfp4())
    fail(kExitUsage, "invalid value for --ctas-per-sm: " + std::to_string(o.ctas_per_sm) +
                         ", needs --weight-format mxfp4 (two CTAs per SM run mxfp4 16-row tiles; --weight-format is " +
                         o.weight_format + ")");
  std::vector<GemmCase> cases;
  for (const std::string& mname : split_list(o.presets)) {
    const ModelShape* ms = nullptr;
    for (const ModelShape& m : kModels)
      if (mname == m.name) ms = &m;
    if (ms == nullptr) fail(kExitUsage, "invalid value for --preset: '" + mname + "', must be deepseek-v3 or qwen3-30b-a3b");
    ModelShape shape = *ms;
    if (o.hidden > 0) shape.hidden = o.hidden;
    if (o.intermediate > 0) shape.intermediate = o.intermediate;
    const std::vector<int64_t> experts =
        parse_int_list_flag("--experts", o.experts.empty() ? ms->experts : o.experts, 1, 1 << 20);
    const std::vector<int64_t> tokens = parse_int_list_flag("--tokens", o.tokens.empty() ? ms->tokens : o.tokens, 1, 1 << 20);
    for (int64_t E : experts)
      for (int64_t T : tokens) {
        std::vector<std::pair<std::string, GemmEpilogue>> fcs;
        if (o.fcs.find("fc1") != std::string::npos) {
          fcs.push_back({"fc1", GemmEpilogue::kStoreBf16});
          if (o.swiglu) fcs.push_back({"fc1+swiglu", GemmEpilogue::kSwigluFp8});
        }
        if (o.fcs.find("fc2") != std::string::npos) fcs.push_back({"fc2", GemmEpilogue::kStoreBf16});
        for (const auto& fc : fcs) {
          GemmCase c;
          c.model = shape;
          c.fc = fc.first;
          c.epilogue = fc.second;
          c.experts = E;
          c.tokens = T;
          const bool is_fc1 = fc.first != "fc2";
          c.n = is_fc1 ? 2 * shape.intermediate : shape.hidden;
          c.k = is_fc1 ? shape.hidden : shape.intermediate;
          c.masked = o.layout == "masked" || (o.layout == "auto" && T <= 32);
          for (int64_t e = 0; e < E; ++e) c.busy += c.empty(e, o.empty_every) ? 0 : 1;
          cases.push_back(c);
        }
      }
  }
  return cases;
}

// A case's device buffers, filled with random finite operands on the GPU; freed on destruction.
struct GemmBuffers {
  void *a = nullptr, *b = nullptr, *d = nullptr;
  float *sa = nullptr, *sb = nullptr, *sd = nullptr;
  int32_t* segments = nullptr;  // masked: counts; contiguous: offsets
  uint64_t* probe_trace = nullptr;
  GemmBuffers(const GemmCase& c, int empty_every, bool probe, bool mxfp4, bool nvfp4, cudaStream_t s) {
    const int64_t E = c.experts, T = c.tokens, N = c.n, K = c.k, M = E * T, M4 = (M + 3) / 4 * 4;
    cuda_check(cudaMalloc(&a, M * K * (nvfp4 ? 2 : 1)), "cudaMalloc(A)");
    const int64_t b_bytes = mxfp4   ? gemm::mxfp4_pieces_offset(E, N, K) + E * (K / 128) * (N / gemm::kFp4SlabRows) *
                                                                               gemm::kFp4SlabBytes
                            : nvfp4 ? gemm::nvfp4_pieces_offset(E) + E * (K / gemm::kNvfp4BlockK) * (N / 64) *
                                                                         gemm::kNvfp4SlabBytes
                                    : E * N * K;
    cuda_check(cudaMalloc(&b, b_bytes), "cudaMalloc(B)");
    cuda_check(cudaMalloc(&d, M * N * 2), "cudaMalloc(D)");
    cuda_check(cudaMalloc(&sa, M4 * (K / 128) * 4 + 64), "cudaMalloc(SFA)");
    cuda_check(cudaMalloc(&sb, E * (N / 128) * (K / 128) * 4), "cudaMalloc(SFB)");
    cuda_check(cudaMalloc(&sd, M4 * (N / 256 + 1) * 4), "cudaMalloc(SFD)");
    cuda_check(cudaMalloc(&segments, (E + 1) * 4), "cudaMalloc(segments)");
    if (nvfp4)
      cuda_check(gemm::fill_random_bf16(a, M * K, 1, s), "fill A (bf16)");
    else
      cuda_check(gemm::fill_random_e4m3(a, M * K, 1, s), "fill A");
    if (nvfp4)
      cuda_check(gemm::fill_random_nvfp4_image(b, E, N, K, 2, s), "fill B (nvfp4)");
    else if (mxfp4)
      cuda_check(gemm::fill_random_mxfp4_image(b, E, N, K, 2, s), "fill B (mxfp4)");
    else
      cuda_check(gemm::fill_random_e4m3(b, E * N * K, 2, s), "fill B");
    cuda_check(gemm::fill_random_f32(sa, M4 * (K / 128), 0.5f, 2.f, 3, s), "fill SFA");
    cuda_check(gemm::fill_random_f32(sb, E * (N / 128) * (K / 128), 0.5f, 2.f, 4, s), "fill SFB");
    std::vector<int32_t> hseg(E + 1);
    for (int64_t e = 0, off = 0; e <= E; ++e) {
      const bool rows = e < E && !c.empty(e, empty_every);
      hseg[e] = int32_t(c.masked ? (rows ? T : 0) : off);
      if (rows) off += T;
    }
    cuda_check(cudaMemcpy(segments, hseg.data(), (E + 1) * 4, cudaMemcpyHostToDevice), "copy segments");
    if (probe) {  // a probe runs in the traced kernel: every launch gets the buffer
      const int64_t words = 1024 * gemm::kTraceWordsHeader + int64_t(kTraceTiles) * gemm::kTraceWordsPerTile;
      cuda_check(cudaMalloc(&probe_trace, words * 8), "cudaMalloc(probe trace)");
    }
  }
  GemmBuffers(const GemmBuffers&) = delete;
  GemmBuffers& operator=(const GemmBuffers&) = delete;
  ~GemmBuffers() {
    for (void* p : {a, b, d, static_cast<void*>(sa), static_cast<void*>(sb), static_cast<void*>(sd),
                    static_cast<void*>(segments), static_cast<void*>(probe_trace)})
      cudaFree(p);
  }
};

// The grouped GEMM's arguments for a case on its buffers, with the tile, schedule and probe flags.
GroupedGemmArgs gemm_args(const GemmCase& c, const GemmBuffers& buf, const BenchOptions& o, int32_t* tile_counter) {
  const bool swiglu = c.epilogue == GemmEpilogue::kSwigluFp8;
  const int64_t M = c.experts * c.tokens;
  GroupedGemmArgs g;
  g.dtype = o.mxfp4() ? GemmDtype::kMxfp4 : o.nvfp4() ? GemmDtype::kNvfp4 : GemmDtype::kFp8Block;
  g.layout = c.masked ? GroupedLayout::kMasked : GroupedLayout::kContiguous;
  // nvfp4: FC1's SwiGLU is the scaled bf16 one (the image's global scales), tokens bf16 without scales
  g.epilogue = o.nvfp4() && swiglu ? GemmEpilogue::kSwigluBf16Scaled : c.epilogue;
  g.num_experts = int32_t(c.experts);
  g.n = int32_t(c.n);
  g.k = int32_t(c.k);
  g.a = buf.a;
  g.m_rows = c.masked ? c.tokens : M;
  g.a_scales = o.nvfp4() ? nullptr : buf.sa;
  g.ld_a_scales = c.masked ? (c.tokens + 3) / 4 * 4 : (M + 3) / 4 * 4;
  g.expert_offsets = c.masked ? nullptr : buf.segments;
  g.masked_counts = c.masked ? buf.segments : nullptr;
  g.b = buf.b;
  g.b_scales = o.fp4() ? nullptr : buf.sb;  // FP4: the image holds its scales
  g.d = buf.d;
  g.d_scales = swiglu && !o.nvfp4() ? buf.sd : nullptr;
  g.expected_m_per_expert = c.tokens;
  g.tiles.block_m = o.block_m;
  g.tiles.block_n = swiglu && o.block_n == 128 ? 0 : o.block_n;
  g.tiles.num_sms = o.num_sms;
  g.tiles.cluster = o.cluster;
  g.tiles.fp4_math_wg = o.fp4_math_wg;
  g.tiles.ctas_per_sm = o.ctas_per_sm;
  g.tile_counter = tile_counter;
  g.tile_order = o.schedule == "static"    ? gemm::GemmTileOrder::kRoundRobin
                 : o.schedule == "dynamic" ? gemm::GemmTileOrder::kCounter
                                           : gemm::GemmTileOrder::kAuto;
  g.weights_evict_first = o.weights_l2 == "evict-first";
  if (buf.probe_trace != nullptr) {
    g.trace = buf.probe_trace;
    g.trace_max_tiles = kTraceTiles;
    g.probe = o.probe == "stream"        ? gemm::GemmProbe::kStream
              : o.probe == "no-epilogue" ? gemm::GemmProbe::kNoEpilogue
              : o.probe == "no-loads"    ? gemm::GemmProbe::kNoLoads
                                         : gemm::GemmProbe::kMathOnly;
  }
  return g;
}

// The text row (stdout) of a case's record; the --json file holds the same records.
const RowPrinter& gemm_printer() {
  static const RowPrinter printer({{"model", "model", -13},
                                   {"fc", "fc", -10},
                                   {"experts", "E", 4, "%lld"},
                                   {"tokens_per_expert", "T/E", 5, "%lld"},
                                   {"layout", "layout", -10},
                                   {"tiles", "tiles", -22},
                                   {"us_median", "us(med)", 9, "%.1f"},
                                   {"us_min", "min", 8, "%.1f"},
                                   {"tflops", "TFLOP/s", 8, "%.1f"},
                                   {"weight_gbs", "wGB/s", 8, "%.0f"},
                                   {"kernel_us_median", "kern_us", 8, "%.1f"},
                                   {"weight_gbs_kernel", "wGB/s(k)", 9, "%.0f"},
                                   {"", "|"},
                                   {"cublas_us", "cublas_us", 9, "%.1f"},
                                   {"cublas_kernel_us", "kern_us", 8, "%.1f"},
                                   {"cublas_tflops", "TFLOP/s", 8, "%.1f"},
                                   {"ratio_to_cublas", "ratio", 6, "%.3f"},
                                   {"time_over_floor", "time/floor", 10, "%.2f"}},
                                  "  ", "# ");
  return printer;
}

std::string gemm_command(const GemmCase& c, const BenchOptions& o) {
  std::ostringstream cmd;
  cmd << "megamoe bench-gemm --preset " << c.model.name;
  if (o.hidden > 0) cmd << " --hidden " << o.hidden;
  if (o.intermediate > 0) cmd << " --intermediate " << o.intermediate;
  cmd << " --experts " << c.experts << " --tokens " << c.tokens << " --fc " << (c.fc == "fc2" ? "fc2" : "fc1")
      << " --layout " << (c.masked ? "masked" : "contiguous");
  if (o.fp4()) cmd << " --weight-format " << o.weight_format;
  if (o.fp4_math_wg != 0) cmd << " --fp4-math-wg " << o.fp4_math_wg;
  if (o.ctas_per_sm != 0) cmd << " --ctas-per-sm " << o.ctas_per_sm;
  if (o.empty_every > 0) cmd << " --empty-every " << o.empty_every;
  return cmd.str();
}

// Times one case (ours, then the cuBLASLt peer of the same M_total x N x K where it applies) and
// returns its record: tiles, times, rates, the floor and the command.
nlohmann::json run_gemm_case(const GemmCase& c, const BenchOptions& o, GroupedGemmArgs* args_out, CublasFp8* cublas,
                             FlushMode flush, int device, cudaStream_t s, int32_t* tile_counter,
                             const GemmBuffers& buf) {
  GroupedGemmArgs g = gemm_args(c, buf, o, tile_counter);
  gemm::GemmTileConfig used;
  Status st = gemm::launch_grouped_gemm(g, s, &used);
  if (!st.is_ok()) fail(kExitUnavailable, st.to_string());
  cuda_check(cudaStreamSynchronize(s), "grouped GEMM run");
  const bool swiglu = c.epilogue == GemmEpilogue::kSwigluFp8;
  const int64_t M_real = c.busy * c.tokens;
  LaunchTiming ours, peer;
  st = time_launches([&] { return gemm::launch_grouped_gemm(g, s); }, device, s, flush, o.iters, o.warmup, &ours);
  if (!st.is_ok()) fail(kExitUnavailable, "grouped GEMM timing: " + st.to_string());
  bool peer_ok = false;
  if (cublas != nullptr && !swiglu && M_real > 0) {  // no peer for a launch of idle experts only
    cublas->run(buf.a, buf.b, buf.d, M_real, c.n, c.k, s, &peer_ok);
    if (peer_ok) {
      st = time_launches(
          [&] {
            bool ok = false;
            cublas->run(buf.a, buf.b, buf.d, M_real, c.n, c.k, s, &ok);
            return ok ? Status::ok() : Status(StatusCode::kInternal, "cublasLtMatmul failed");
          },
          device, s, flush, o.iters, o.warmup, &peer);
      if (!st.is_ok()) fail(kExitUnavailable, "cuBLASLt timing: " + st.to_string());
    }
  }
  // the rows and weights the launch works on (idle experts excluded)
  const double flops = 2.0 * double(M_real) * double(c.n) * double(c.k);
  const double wbytes = double(c.busy) * double(c.n) * double(c.k) / (o.fp4() ? 2 : 1);
  const double t = ours.events.median * 1e-6;
  nlohmann::json r;
  r["model"] = c.model.name;
  r["fc"] = c.fc;
  r["experts"] = c.experts;
  r["tokens_per_expert"] = c.tokens;
  r["n"] = c.n;
  r["k"] = c.k;
  r["weight_format"] = o.weight_format;
  r["layout"] = std::string(c.masked ? "masked" : "contiguous") +
                (o.empty_every > 0 ? "/e" + std::to_string(o.empty_every) : "");
  r["tiles"] = std::to_string(used.block_m) + "x" + std::to_string(used.block_n) +
               (used.cluster > 1 ? " x" + std::to_string(used.cluster) + " g" + std::to_string(used.grid) : "") +
               (used.fp4_math_wg > 0 ? " wg" + std::to_string(used.fp4_math_wg) : "") +
               (used.ctas_per_sm > 1 ? " " + std::to_string(used.ctas_per_sm) + "/sm" : "") +
               (used.round_robin ? " static" : "") + (o.probe != "none" ? " probe:" + o.probe : "");
  r["us_median"] = ours.events.median;
  r["us_min"] = ours.events.min;
  r["us_max"] = ours.events.max;
  r["tflops"] = flops / t / 1e12;
  r["weight_gbs"] = wbytes / t / 1e9;
  r["kernel_us_median"] = ours.kernels.median;
  r["kernel_us_min"] = ours.kernels.min;
  r["weight_gbs_kernel"] = ours.kernels.median > 0 ? wbytes / (ours.kernels.median * 1e-6) / 1e9 : 0;
  r["cublas_us"] = peer_ok ? peer.events.median : 0;
  r["cublas_kernel_us"] = peer_ok ? peer.kernels.median : 0;
  r["cublas_tflops"] = peer_ok ? flops / (peer.events.median * 1e-6) / 1e12 : 0;
  r["ratio_to_cublas"] = peer_ok ? peer.events.median / ours.events.median : 0;
  set_floor(&r, ours.events.median, std::max(wbytes / kH200HbmBytesPerS, flops / kH200Fp8FlopsPerS) * 1e6);
  r["command"] = gemm_command(c, o);
  *args_out = g;
  return r;
}

// The device (sm_90) and the table's header lines.
int open_gemm_device(const BenchOptions& o) {
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) fail(kExitUnavailable, "no CUDA device");
  cudaDeviceProp prop;
  cuda_check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  if (prop.major != 9) fail(kExitUnavailable, std::string("bench-gemm needs an sm_90 GPU, found ") + prop.name);
  std::printf("# bench-gemm on %s (%d SMs); floor = max(weight bytes / %.1f TB/s, FLOPs / %.0f TFLOP/s); L2 flush: %s\n",
              prop.name, prop.multiProcessorCount, kH200HbmBytesPerS / 1e12, kH200Fp8FlopsPerS / 1e12,
              to_string(o.flush == "read" ? FlushMode::kRead : FlushMode::kMemset));
  if (KernelTimer::get() == nullptr)
    std::printf("# kernel time (kern_us, wGB/s(k)): not measured: %s\n", KernelTimer::why_unavailable().c_str());
  else
    std::printf("# kern_us: median kernel time from the GPU's timestamps (CUPTI); wGB/s(k): weight bytes / kern_us\n");
  std::printf("%s\n", gemm_printer().header().c_str());
  return 0;
}

int run_bench_gemm(const BenchOptions& o) {
  const std::vector<GemmCase> cases = plan_gemm_cases(o);  // flags first, then the machine
  const int device = open_gemm_device(o);
  const FlushMode flush = o.flush == "read" ? FlushMode::kRead : FlushMode::kMemset;
  cudaStream_t s;
  cuda_check(cudaStreamCreate(&s), "cudaStreamCreate");
  int32_t* tile_counter = nullptr;  // the GEMM leaves it zero after each launch
  cuda_check(cudaMalloc(&tile_counter, 2 * sizeof(int32_t)), "cudaMalloc(tile counter)");
  cuda_check(cudaMemset(tile_counter, 0, 2 * sizeof(int32_t)), "cudaMemset(tile counter)");
  std::unique_ptr<CublasFp8> cublas = o.cublas && !o.fp4() ? std::make_unique<CublasFp8>() : nullptr;
  std::ofstream trace_json;
  if (!o.trace.empty()) {
    trace_json.open(o.trace);
    if (!trace_json) fail(kExitIo, "cannot write --trace file '" + o.trace + "'");
    trace_json << "[\n";
  }
  nlohmann::json records = nlohmann::json::array();
  for (const GemmCase& c : cases) {
    const GemmBuffers buf(c, o.empty_every, o.probe != "none", o.mxfp4(), o.nvfp4(), s);
    GroupedGemmArgs args;
    const nlohmann::json r = run_gemm_case(c, o, &args, cublas.get(), flush, device, s, tile_counter, buf);
    std::printf("%s   # %s\n", gemm_printer().row(r).c_str(), r["command"].get<std::string>().c_str());
    std::fflush(stdout);
    if (!o.trace.empty()) {
      if (!records.empty()) trace_json << ",\n";
      trace_case(args, flush, s, double(c.busy) * double(c.n) * double(c.k) / (o.fp4() ? 2 : 1),
                 c.model.name + std::string(" ") + c.fc + " " + std::to_string(c.experts) + "x" + std::to_string(c.tokens),
                 &trace_json);
      std::fflush(stdout);
    }
    records.push_back(r);
  }
  if (trace_json.is_open()) trace_json << "\n]\n";
  cublas.reset();
  cudaFree(tile_counter);
  cudaStreamDestroy(s);
  if (!o.json.empty()) write_json_file(o.json, records);
  return kExitOk;
}

CLI::App* add_flags(CLI::App* app, BenchOptions* o) {
  CLI::App* sub = app->add_subcommand(
      "bench-gemm", "time the experts' grouped GEMM (fp8 block-scaled, sm_90a) against cuBLASLt dense fp8 of the same size");
  sub->add_option("--preset", o->presets, "models, comma-separated: deepseek-v3, qwen3-30b-a3b")->capture_default_str();
  sub->add_option("--experts", o->experts, "local experts, comma-separated (default: 32,128 / 64)");
  sub->add_option("--tokens", o->tokens, "rows per expert, comma-separated (default: 8,32,128,512,2048 / 8,32,256,1024)");
  sub->add_option("--hidden", o->hidden, "hidden size H instead of the preset's (FC1 K, FC2 N; a multiple of 128)")
      ->check(CLI::Range(int64_t(128), int64_t(1) << 16));
  sub->add_option("--intermediate", o->intermediate,
                  "expert intermediate size I instead of the preset's (FC1 N = 2I, FC2 K; a multiple of 128)")
      ->check(CLI::Range(int64_t(128), int64_t(1) << 16));
  sub->add_option("--fc", o->fcs, "fc1, fc2 or fc1,fc2")->capture_default_str();
  sub->add_option("--layout", o->layout, "auto (masked at <= 32 rows per expert), contiguous or masked")->capture_default_str();
  sub->add_option("--empty-every", o->empty_every,
                  "every N-th expert gets no rows, as idle experts in a decode step (default 0: none)")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_flag("!--no-swiglu", o->swiglu, "skip the FC1 + SwiGLU + fp8 requant rows");
  sub->add_flag("!--no-cublas", o->cublas, "skip the cuBLASLt peer");
  sub->add_option("--weight-format", o->weight_format,
                  "fp8-block, mxfp4 (e2m1 expanded to e4m3 in the kernel; 16-, 32- and 64-row tiles) or nvfp4 (e2m1 x "
                  "e4m3 scale expanded to bf16 in the kernel, bf16 tokens; 16- and 32-row tiles); FP4: no cuBLASLt "
                  "peer, wGB/s of FP4 bytes")
      ->check(CLI::IsMember({"fp8-block", "mxfp4", "nvfp4"}))
      ->capture_default_str();
  sub->add_option("--fp4-math-wg", o->fp4_math_wg,
                  "mxfp4: math warpgroups per tile, 1 or 2 (two split each weight tile's expansion and wgmmas; "
                  "default: the GEMM's, 2)")
      ->check(CLI::IsMember({1, 2}));
  sub->add_option("--ctas-per-sm", o->ctas_per_sm,
                  "mxfp4: CTAs per SM of the 16-row tiles, 1 or 2 (two: each with half of the SM's registers and "
                  "shared memory, two tiles at once per SM; default: the GEMM's, " +
                      std::to_string(gemm::kDefaultFp4CtasPerSm) + ")")
      ->check(CLI::IsMember({1, 2}));
  sub->add_option("--block-m", o->block_m, "tile rows: 16, 32, 64 or 128 (default: heuristic)")->check(CLI::IsMember({16, 32, 64, 128}));
  sub->add_option("--block-n", o->block_n, "tile columns: 128 or 256 (default: heuristic)")->check(CLI::IsMember({128, 256}));
  sub->add_option("--num-sms", o->num_sms, "persistent CTAs (default: all SMs)")->check(CLI::Range(1, 1 << 20));
  sub->add_option("--cluster", o->cluster,
                  "CTAs per cluster sharing each weight tile by TMA multicast: 1 or 2 (fp8 128 x 256 tiles; default: "
                  "the heuristic's)")
      ->check(CLI::Range(1, 2));
  sub->add_option("--schedule", o->schedule,
                  "tile order: auto (the heuristic's), dynamic (tiles in order from a global counter) or static (round-robin)")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "dynamic", "static"}));
  sub->add_option("--flush", o->flush,
                  "L2 flush before each timed launch: memset (256 MiB written: L2 left dirty, as DeepGEMM's harness) or "
                  "read (256 MiB read: L2 left clean)")
      ->capture_default_str()
      ->check(CLI::IsMember({"memset", "read"}));
  sub->add_option("--weights-l2", o->weights_l2,
                  "L2 policy of the weight tiles each read by one tile only (experts of <= BLOCK_M rows): evict-first "
                  "or normal")
      ->capture_default_str()
      ->check(CLI::IsMember({"evict-first", "normal"}));
  sub->add_option("--probe", o->probe,
                  "where the time goes (the output is not computed): stream (the math only waits for and releases "
                  "each K block: the weight stream alone), no-epilogue, no-loads (the producer issues no copies, the "
                  "math runs on stale shared memory) or math-only (no loads, no epilogue: the K loops alone)")
      ->capture_default_str()
      ->check(CLI::IsMember({"none", "stream", "no-epilogue", "no-loads", "math-only"}));
  sub->add_option("--trace", o->trace,
                  "after each case, one more launch with the kernel's timeline (per CTA and tile): a summary line, and "
                  "the stamps as JSON in this file");
  sub->add_option("--iters", o->iters, "timed launches per case")->capture_default_str()->check(CLI::Range(1, 100000));
  sub->add_option("--warmup", o->warmup, "untimed launches per case")->capture_default_str()->check(CLI::Range(0, 1000));
  sub->add_option("--json", o->json, "also write the rows as JSON to this file");
  return sub;
}

}  // namespace

CommandRun add_gemm_bench_command(CLI::App* app) {
  auto o = std::make_shared<BenchOptions>();
  add_flags(app, o.get());
  return [o] { return run_bench_gemm(*o); };
}

}  // namespace megamoe::tool
