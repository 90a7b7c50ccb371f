// `megamoe bench`: timed forwards, one row per (backend, tokens) case, with the H200 floor.
//
// Per case: one layer per rank (max_tokens_per_rank = the case's tokens unless --max-tokens), warmed
// up, then warm-up forwards and timed forwards with all ranks in lockstep (a barrier before each
// forward); the time of one forward is the wall time from the first rank's start to the last rank's
// end (the slowest rank). Inputs rotate among a few sets drawn from one generated problem; on a CUDA
// device the L2 is flushed before each forward (outside the timed region).
//
// Weights: each rank generates only its own experts' fp32 slice, on its own thread, and frees it as
// soon as its layer has prepared its copy (ranks.h, build_group). Where the prepared format can be
// handed back bit for bit (fp8-block, bf16), the first case keeps a copy of every rank's prepared
// weights and the later cases build from it instead of generating and quantising again.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <CLI/CLI.hpp>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench_model.h"
#include "bench_harness.h"
#include "bench_output.h"
#include "commands.h"
#include "forward_timing.h"
#include "kept_weights.h"
#include "plot.h"
#include "core/device.h"
#include "megamoe/layer.h"
#include "presets.h"
#include "ranks.h"
#include "reference/problem.h"

namespace megamoe::tool {
namespace {

using Clock = std::chrono::steady_clock;

struct BenchOptions {
  LayerOptions layer;
  std::string backends;  // empty: auto (cpu in the default no-device mode)
  std::string tokens;    // empty: per the resolved backend (cpu: 1,16,128; GPU: 1,16,128,1024,8192)
  std::string iters, warmup, input_sets = "4";
  std::string routing = "uniform", seed = "1";
  std::string json, csv, plot;
  std::string layers = "1";  // --layers N
  MaxHostGbOption max_host_gb;
};

constexpr const char* kCpuDefaultTokens = "1,16,128";
constexpr const char* kGpuDefaultTokens = "1,16,128,1024,8192";


// The backend a case would run on, without building anything.
Backend resolve(const MoeGeometry& g, const MoeConfig& c) {
  return c.backend == Backend::kAuto ? select_backend(g, c).backend : c.backend;
}

std::string reproduce_command(const BenchOptions& o, const std::string& preset, Backend b, int64_t tokens,
                              int64_t iters, int64_t warmup, int64_t sets) {
  const LayerOptions& l = o.layer;
  std::string cmd = "megamoe bench --preset " + shell_quote(preset) + " --backend " + to_string(b) + " --ep " +
                    shell_quote(l.ep) + " --tokens " + std::to_string(tokens) + " --iters " + std::to_string(iters) +
                    " --warmup " + std::to_string(warmup) + " --weight-format " + shell_quote(l.weight_format) +
                    " --dispatch-format " + shell_quote(l.dispatch_format) + " --combine-dtype " +
                    shell_quote(l.combine_dtype);
  if (l.in_kernel_fc2_reduce) cmd += " --in-kernel-fc2-reduce";
  if (l.owner_reduce) cmd += " --owner-reduce";
  if (l.no_owner_reduce) cmd += " --no-owner-reduce";
  if (l.pow2_scales) cmd += " --pow2-scales";
  if (l.shared_gpu) cmd += " --shared-gpu";
  if (o.layers != "1") cmd += " --layers " + shell_quote(o.layers);
  if (!l.experts.empty()) cmd += " --experts " + shell_quote(l.experts);
  if (!l.max_tokens.empty()) cmd += " --max-tokens " + shell_quote(l.max_tokens);
  if (l.pad) cmd += " --pad";
  cmd += " --routing " + shell_quote(o.routing) + " --seed " + shell_quote(o.seed) + " --input-sets " +
         std::to_string(sets);
  return cmd;
}

// A few more lockstep forwards with the layers' stage timing on; fills row->stages_us with, per
// stage, the slowest rank's median. Leaves it empty for backends without stage timing (cpu).
void collect_stage_times(const ProcessRanks& pr, RankGroup& group, CaseIo& io, int64_t samples, BenchRow* row) {
  const int64_t R = static_cast<int64_t>(group.layers.size());
  if (samples <= 0 || !first_local_layer(group)->set_stage_timing(true)) return;  // same backend on every rank
  std::vector<std::vector<std::vector<double>>> us(static_cast<size_t>(R));  // [rank][stage][sample]
  std::vector<std::string> names;
  Status st = run_on_local_ranks(pr, [&](int64_t r) { return group.layers[r]->set_stage_timing(true); });
  LockstepOptions o;
  o.iters = samples;
  o.after_forward = [&](int64_t r, int64_t) -> Status {
    std::vector<MoeLayer::StageTime> t;
    MEGAMOE_RETURN_IF_ERROR(group.layers[r]->last_stage_times(&t));
    us[r].resize(t.size());
    for (size_t i = 0; i < t.size(); ++i) us[r][i].push_back(t[i].us);
    if (r == pr.first() && names.empty())
      for (const auto& s : t) names.push_back(s.stage);
    return Status::ok();
  };
  LockstepTimes times;
  if (st) st = time_lockstep_forwards(pr, group, io, o, &times);
  run_on_local_ranks(pr, [&](int64_t r) { return group.layers[r]->set_stage_timing(false); });
  if (!st) {
    std::fprintf(stderr, "[bench]   no stage breakdown: %s\n", st.message().c_str());
    return;
  }
  for (size_t i = 0; i < names.size(); ++i) {
    double slowest = 0;
    for (int64_t r = 0; r < R; ++r)
      if (pr.runs(r)) slowest = std::max(slowest, summarize(us[r][i]).median);
    row->stages_us.emplace_back(names[i], slowest);
  }
}

// The row's rates and floor from its median and the case's model.
void fill_rates(const ForwardModel& model, int64_t R, BenchRow* row) {
  const double t = row->median_us * 1e-6;
  row->tflops_per_rank = model.flops / static_cast<double>(R) / t / 1e12;
  row->hbm_gbps_per_rank = model.weight_bytes / static_cast<double>(R) / t / 1e9;
  row->nvlink_gbps_per_rank = model.nvlink_bytes / static_cast<double>(R) / t / 1e9;
  row->floor_us = model.floor_s * 1e6;
  row->floor_bound = model.bound;
  row->time_over_floor = model.floor_s > 0 ? t / model.floor_s : 0;
}

// Times one case. Fills row.median_us etc., or row.error.
// --layers N: the N - 1 further layers of one case (built from the first's prepared weights: the same
// values, each its own device copy; the workspace is the first's, shared through WorkspacePool), and
// per rank and input set one CUDA graph of the N chained forwards (GPU backends), replayed as one
// timed forward. Graphs are captured after warmup (the layers' collective work is done).
struct LayerStack {
  std::vector<std::unique_ptr<RankGroup>> more;           // layers 1 .. N-1
  std::vector<std::vector<MoeLayer*>> chain;              // [rank]: the N layers in order
  std::vector<std::vector<cudaGraphExec_t>> graphs;       // [rank][set]
  ~LayerStack() {
    for (auto& per_rank : graphs)
      for (cudaGraphExec_t g : per_rank)
        if (g) cudaGraphExecDestroy(g);
  }
};

Status build_layer_stack(const MoeGeometry& g, const MoeConfig& c, uint64_t seed, const ProcessRanks& pr,
                         KeptWeights* kept, RankGroup& first, CaseIo& io, int64_t layers, bool on_gpu, LayerStack* s) {
  const int64_t R = g.ep_size;
  for (int64_t l = 1; l < layers; ++l) {
    s->more.push_back(std::make_unique<RankGroup>());
    MEGAMOE_RETURN_IF_ERROR(build_group_reusing(g, c, seed, pr, kept, s->more.back().get(), "[bench]"));
  }
  s->chain.assign(static_cast<size_t>(R), {});
  s->graphs.assign(static_cast<size_t>(R), {});
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    s->chain[r].push_back(first.layers[r].get());
    for (const auto& m : s->more) s->chain[r].push_back(m->layers[r].get());
    for (auto& set : io[r]) MEGAMOE_RETURN_IF_ERROR(set->reserve_chain());
  }
  if (!on_gpu) return Status::ok();
  return run_on_local_ranks(pr, [&](int64_t r) -> Status {
    void* stream = nullptr;
    MEGAMOE_RETURN_IF_ERROR(create_rank_stream(first, r, &stream));
    Status st;
    for (auto& set : io[r]) {
      cudaGraph_t graph = nullptr;
      cudaGraphExec_t exec = nullptr;
      cudaStream_t cs = static_cast<cudaStream_t>(stream);
      if (cudaStreamBeginCapture(cs, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        st = Status(StatusCode::kCudaError, "rank " + std::to_string(r) + ": cannot begin a CUDA-graph capture");
        break;
      }
      st = set->forward_layers(s->chain[r], stream);
      const cudaError_t end = cudaStreamEndCapture(cs, &graph);
      if (st && end != cudaSuccess)
        st = Status(StatusCode::kCudaError, std::string("capture of the layers' forwards failed: ") + cudaGetErrorString(end));
      if (st && cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess)
        st = Status(StatusCode::kCudaError, "instantiating the layers' graph failed");
      if (graph) cudaGraphDestroy(graph);
      if (!st) break;
      s->graphs[r].push_back(exec);
    }
    destroy_rank_stream(first, r, stream);
    if (!st) return Status(st.code(), "rank " + std::to_string(r) + " --layers: " + st.message());
    return st;
  });
}

void run_case(const MoeGeometry& g, const MoeConfig& c, uint64_t seed, const ProcessRanks& pr,
              const std::vector<reference::RankInputs>& inputs, int64_t tokens, int64_t sets, int64_t iters,
              int64_t warmup, KeptWeights* kept, BenchRow* row) {
  const int64_t R = g.ep_size, k = g.top_k;
  RankGroup group;
  Status st = build_group_reusing(g, c, seed, pr, kept, &group, "[bench]");
  if (!st) {
    row->error = st.message();
    return;
  }
  const MoeLayer* layer0 = first_local_layer(group);
  row->resolved = to_string(layer0->backend());
  row->on_gpu = layer0->device().kind == DeviceKind::kCuda;
  CaseIo io;
  if (st = stage_case_io(pr, group, inputs, tokens, sets, &io); !st) {
    row->error = st.message();
    return;
  }
  // Every rank's routing of every set (the floor counts the experts all ranks hit).
  std::vector<std::vector<const int32_t*>> ids(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < sets; ++s) ids[r].push_back(inputs[r].topk_ids.data() + s * tokens * k);
  const ForwardModel model = model_forward(g, c, tokens, sets, ids);

  LockstepOptions o;
  o.warmup = warmup;
  o.iters = iters;
  LayerStack stack;
  if (row->layers > 1) {
    if (st = build_layer_stack(g, c, seed, pr, kept, group, io, row->layers, row->on_gpu, &stack); !st) {
      row->error = st.message();
      return;
    }
    o.run_forward = [&](int64_t r, int64_t it, void* stream) -> Status {
      if (!row->on_gpu) return io[r][it % sets]->forward_layers(stack.chain[r], stream);
      const cudaError_t e = cudaGraphLaunch(stack.graphs[r][it % sets], static_cast<cudaStream_t>(stream));
      if (e != cudaSuccess) return Status(StatusCode::kCudaError, std::string("graph launch: ") + cudaGetErrorString(e));
      return Status::ok();
    };
  }
  const Clock::time_point began = Clock::now();
  Clock::time_point last_progress = began;
  o.progress = [&](int64_t done, int64_t total) {
    const Clock::time_point now = Clock::now();
    if (std::chrono::duration<double>(now - last_progress).count() <= 2.0) return;
    last_progress = now;
    std::fprintf(stderr, "[bench]   %s T=%lld: %lld/%lld forwards (%.0f s)\n", row->resolved.c_str(),
                 static_cast<long long>(tokens), static_cast<long long>(done), static_cast<long long>(total),
                 std::chrono::duration<double>(now - began).count());
  };
  LockstepTimes times;
  if (st = time_lockstep_forwards(pr, group, io, o, &times); !st) {
    row->error = st.message();
    return;
  }
  const Summary s = summarize(times.slowest_per_forward(/*sampled=*/false));
  const double per_layer = 1.0 / static_cast<double>(row->layers);  // --layers: a forward of N layers
  row->median_us = s.median * per_layer;
  row->min_us = s.min * per_layer;
  row->max_us = s.max * per_layer;
  fill_rates(model, R, row);
  if (row->on_gpu) collect_stage_times(pr, group, io, std::min<int64_t>(iters, 10), row);
}

// What the flags ask for, checked: the cases (backend x tokens), the input sets and the generator.
struct BenchPlan {
  bool default_mode = false;  // no --preset
  std::vector<Backend> backends;
  std::vector<int64_t> tokens;
  int64_t t_max = 0, sets = 0;       // the largest case; input sets (t_max * sets <= 2^20 tokens)
  int64_t max_tokens_override = 0;   // --max-tokens, 0: each case's tokens
  int64_t sets_flag = 4;
  uint64_t seed = 1;
  reference::Routing routing = reference::Routing::kUniform;
  HostMemoryLimit limit;
};

// The default run (no --preset): deepseek-v3 on a CUDA machine, the tiny preset without one.
void choose_default_run(BenchOptions* o) {
  std::string no_device_reason;
  const bool has_device = cuda_device_count(&no_device_reason) > 0;
  if (has_device) {
    o->layer.preset = "deepseek-v3";
    return;
  }
  if (o->backends.empty()) o->backends = "cpu";
  if (o->backends == "cpu")
    std::printf("%s: running the cpu backend on the tiny preset\n", no_device_reason.c_str());
  else
    std::printf("%s: running --backend %s on the tiny preset\n", no_device_reason.c_str(), o->backends.c_str());
  o->layer.preset = "tiny";
}

// The token list: --tokens, else the default of the backends the cases resolve to.
void choose_tokens(const BenchOptions& o, BenchPlan* plan, bool cpu_default) {
  auto any_on_cpu = [&](const std::string& tokens_text) {
    for (Backend b : plan->backends)
      for (int64_t t : parse_int_list_flag("--tokens", tokens_text, 1, 1 << 20))
        if (resolve(make_geometry(o.layer, t), make_config(o.layer, b)) == Backend::kCpu) return true;
    return false;
  };
  const std::string text = !o.tokens.empty() ? o.tokens
                           : cpu_default || any_on_cpu(kGpuDefaultTokens) ? kCpuDefaultTokens
                                                                          : kGpuDefaultTokens;
  plan->tokens = parse_int_list_flag("--tokens", text, 1, 1 << 20);
  plan->t_max = *std::max_element(plan->tokens.begin(), plan->tokens.end());
  if (plan->max_tokens_override && plan->max_tokens_override < plan->t_max)
    throw ToolError(kExitUsage, "invalid value for --max-tokens: " + o.layer.max_tokens +
                                    ", must be at least the largest --tokens value " + std::to_string(plan->t_max));
  plan->sets = std::max<int64_t>(1, std::min<int64_t>(plan->sets_flag, (1 << 20) / plan->t_max));
}

// Host memory of one case's layers at a time, each built from per-rank slices, for `preset`.
std::function<HostMemoryEstimate(const MoeGeometry&)> host_memory_of(const BenchOptions& o, const BenchPlan& plan,
                                                                     const std::string& preset, MoeGeometry* g_out) {
  LayerOptions l = o.layer;
  l.preset = preset;
  *g_out = make_geometry(l, plan.t_max * plan.sets);
  bool cpu = false;
  for (Backend b : plan.backends)
    for (int64_t t : plan.tokens) cpu = cpu || resolve(make_geometry(l, t), make_config(l, b)) == Backend::kCpu;
  const int64_t tokens = plan.t_max * plan.sets;
  return [l, cpu, tokens](const MoeGeometry& gx) {
    return estimate_host_memory(gx, make_config(l, Backend::kAuto), cpu ? Backend::kCpu : Backend::kMega, tokens,
                                /*dequantised_copy=*/false);
  };
}

// Refuses a run above the host-memory limit; the default run falls back to the tiny preset instead.
void fit_host_memory(BenchOptions* o, BenchPlan* plan) {
  MoeGeometry g_mem;
  auto estimate = host_memory_of(*o, *plan, o->layer.preset, &g_mem);
  HostMemoryEstimate mem = estimate(g_mem);
  if (!fits_host_memory(mem, plan->limit) && plan->default_mode && o->layer.preset != "tiny") {
    const BackendSelection sel =
        select_backend(make_geometry(o->layer, plan->t_max), make_config(o->layer, Backend::kAuto));
    std::printf("backend auto resolved to %s on %s (%s), which needs %s of host memory, above the limit of %s: "
                "falling back to the tiny preset\n",
                to_string(sel.backend), o->layer.preset.c_str(), sel.reason.c_str(), format_bytes(mem.bytes).c_str(),
                format_bytes(plan->limit.bytes).c_str());
    o->layer.preset = "tiny";
    if (o->tokens.empty()) choose_tokens(*o, plan, /*cpu_default=*/true);
    estimate = host_memory_of(*o, *plan, o->layer.preset, &g_mem);
    mem = estimate(g_mem);
  }
  if (!fits_host_memory(mem, plan->limit))
    require_host_memory(mem, plan->limit, o->layer.preset, experts_hint(g_mem, plan->limit, estimate));
}

BenchPlan plan_bench(BenchOptions* o) {
  BenchPlan plan;
  plan.default_mode = o->layer.preset.empty();
  if (plan.default_mode) choose_default_run(o);
  if (o->backends.empty()) o->backends = "auto";
  for (const std::string& b : split_list(o->backends)) plan.backends.push_back(parse_backend_flag("--backend", b));
  plan.routing = parse_routing_flag(o->routing);
  plan.seed = static_cast<uint64_t>(parse_int_flag("--seed", o->seed, 0, INT64_MAX));
  plan.limit = host_memory_limit(o->max_host_gb);
  plan.sets_flag = parse_int_flag("--input-sets", o->input_sets, 1, 64);
  if (!o->plot.empty()) check_plot_path(o->plot, "--plot");
  // Validates the preset and flags before anything else runs.
  (void)make_geometry(o->layer, 1);
  (void)make_config(o->layer, Backend::kAuto);
  plan.max_tokens_override =
      o->layer.max_tokens.empty() ? 0 : parse_int_flag("--max-tokens", o->layer.max_tokens, 1, 1 << 20);
  choose_tokens(*o, &plan, /*cpu_default=*/false);
  fit_host_memory(o, &plan);
  return plan;
}

// The geometry of the case of `tokens` tokens per rank.
MoeGeometry case_geometry(const BenchOptions& o, const BenchPlan& plan, int64_t tokens) {
  return make_geometry(o.layer, plan.max_tokens_override ? plan.max_tokens_override : tokens);
}

// One row per (backend, tokens) case, in that order, with its iteration counts and command.
std::vector<BenchRow> plan_rows(const BenchOptions& o, const BenchPlan& plan) {
  std::vector<BenchRow> rows;
  for (Backend b : plan.backends)
    for (int64_t t : plan.tokens) {
      BenchRow row;
      row.backend = to_string(b);
      row.tokens = t;
      const Backend resolved = resolve(case_geometry(o, plan, t), make_config(o.layer, b));
      row.resolved = to_string(resolved);
      row.iters = o.iters.empty() ? (resolved == Backend::kCpu ? 10 : 100) : parse_int_flag("--iters", o.iters, 1, 1000000);
      row.warmup =
          o.warmup.empty() ? (resolved == Backend::kCpu ? 2 : 10) : parse_int_flag("--warmup", o.warmup, 0, 1000000);
      row.command = reproduce_command(o, o.layer.preset, b, t, row.iters, row.warmup, plan.sets);
      row.layers = parse_int_flag("--layers", o.layers, 1, 64);
      rows.push_back(row);
    }
  return rows;
}

// Every rank's inputs (also in a launched process: the floor counts the experts all ranks hit):
// t_max * sets tokens per rank, sliced into the input sets by each case.
std::vector<reference::RankInputs> generate_inputs(const MoeGeometry& g, const BenchPlan& plan) {
  std::fprintf(stderr, "[bench] generating %lld input sets of up to %lld tokens per rank\n",
               static_cast<long long>(plan.sets), static_cast<long long>(plan.t_max));
  const int64_t R = g.ep_size;
  std::vector<reference::RankInputs> inputs(static_cast<size_t>(R));
  const int input_threads = std::max<int>(1, reference::default_generate_threads() / static_cast<int>(R));
  const Status gen = run_on_ranks(R, [&](int64_t r) {
    inputs[r] = reference::make_rank_inputs(g, plan.seed, r, plan.t_max * plan.sets, plan.routing, input_threads);
    return Status::ok();
  });
  if (!gen) throw ToolError(kExitUnavailable, "generating the inputs: " + gen.message());
  return inputs;
}

int run_bench(BenchOptions o) {
  const BenchPlan plan = plan_bench(&o);
  std::vector<BenchRow> rows = plan_rows(o, plan);
  BenchHeader header;
  header.preset = o.layer.preset;
  header.geometry = make_geometry(o.layer, plan.t_max);
  header.config = make_config(o.layer, Backend::kAuto);
  header.routing = o.routing;
  header.sets = plan.sets;
  bool all_on_gpu = true;
  for (const BenchRow& row : rows) {
    all_on_gpu = all_on_gpu && (row.resolved == "routed" || row.resolved == "mega");
    header.any_cpu = header.any_cpu || row.resolved == "cpu";
  }
  ProcessRanks pr;
  if (const Status st = process_ranks(header.geometry.ep_size, all_on_gpu, &pr, o.layer.shared_gpu); !st)
    throw ToolError(st.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitUnavailable, st.message());
  const std::vector<reference::RankInputs> inputs = generate_inputs(header.geometry, plan);

  print_bench_header(header);
  if (pr.launched) std::printf("%s: times are this rank's (each process reports its own)\n", pr.describe().c_str());
  if (pr.shared_gpu) std::printf("%s: SMs / R each (the NVLink floor does not apply)\n", pr.describe().c_str());
  if (const int64_t n = parse_int_flag("--layers", o.layers, 1, 64); n > 1)
    std::printf("--layers %lld: each timed forward runs %lld layers (distinct weight copies, one workspace, one CUDA "
                "graph per rank on a GPU); times and rates are per layer\n",
                static_cast<long long>(n), static_cast<long long>(n));
  int exit_code = kExitOk;
  KeptWeights kept;  // the weights are generated by the first case, per rank (build_group_reusing)
  for (size_t i = 0; i < rows.size(); ++i) {
    BenchRow& row = rows[i];
    const Backend b = plan.backends[i / plan.tokens.size()];
    const MoeGeometry g = case_geometry(o, plan, row.tokens);
    const MoeConfig c = make_config(o.layer, b);
    std::fprintf(stderr, "[bench] case %zu/%zu: backend %s, %lld tokens per rank, %lld + %lld forwards\n", i + 1,
                 rows.size(), row.backend.c_str(), static_cast<long long>(row.tokens),
                 static_cast<long long>(row.warmup), static_cast<long long>(row.iters));
    if (b == Backend::kMega || b == Backend::kRouted) {
      const Status gate = b == Backend::kMega ? mega_capability(g, c) : routed_capability(g, c);
      if (!gate) row.error = std::string("backend=") + to_string(b) + " is unavailable: " + gate.message();
    }
    if (row.error.empty())
      run_case(g, c, plan.seed, pr, inputs, row.tokens, plan.sets, row.iters, row.warmup, &kept, &row);
    if (!row.error.empty()) exit_code = kExitUnavailable;
    print_bench_row(row);
    std::fflush(stdout);
  }
  if (!o.json.empty()) write_bench_json(o.json, header, rows);
  if (!o.csv.empty()) write_bench_csv(o.csv, rows);
  if (!o.plot.empty()) plot_json(bench_document(header, rows), o.plot, "--plot");
  return exit_code;
}

}  // namespace

CommandRun add_bench_command(CLI::App* app) {
  auto o = std::make_shared<BenchOptions>();
  CLI::App* sub = app->add_subcommand(
      "bench", "timed forwards, one row per (backend, tokens) case, with the H200 floor; with no flags: deepseek-v3 "
               "and backend auto on a CUDA machine, the cpu backend on the tiny preset without one");
  sub->add_option("--preset", o->layer.preset, "model preset: " + preset_names())->type_name("P");
  sub->add_option("--backend", o->backends, "comma-separated: auto | mega | routed | cpu (default auto)")
      ->type_name("B[,B...]");
  sub->add_option("--tokens", o->tokens,
                  std::string("comma-separated tokens per rank (default ") + kGpuDefaultTokens +
                      ", or " + kCpuDefaultTokens + " when a case runs on the cpu backend)")
      ->type_name("T1[,T2...]");
  sub->add_option("--iters", o->iters, "timed forwards per case (default 100 on a GPU, 10 on the cpu backend)")
      ->type_name("N");
  sub->add_option("--warmup", o->warmup, "untimed forwards first (default 10 on a GPU, 2 on the cpu backend)")
      ->type_name("N");
  sub->add_option("--input-sets", o->input_sets, "input sets rotated among the forwards")
      ->type_name("N")
      ->default_str(o->input_sets);
  sub->add_option("--routing", o->routing, "uniform | single-expert | dropped")->type_name("R")->default_str(o->routing);
  sub->add_option("--seed", o->seed, "seed of the weights and inputs")->type_name("S")->default_str(o->seed);
  sub->add_option("--layers", o->layers,
                  "N layers of the geometry per forward, as a model's decode step runs them: each with its own "
                  "copy of the weights, all sharing one workspace, chained (layer l reads layer l-1's output); "
                  "on a GPU one CUDA graph of the N forwards per rank, replayed; times are per layer")
      ->type_name("N")
      ->default_str(o->layers);
  sub->add_option("--json", o->json, "write the rows as JSON to F")->type_name("F");
  sub->add_option("--csv", o->csv, "write the rows as CSV to F")->type_name("F");
  sub->add_option("--plot", o->plot, "plot median us and time/floor against tokens per rank, one line per backend, "
                                     "to F.png (python3 with matplotlib)")
      ->type_name("F.png");
  add_max_host_gb_option(sub, &o->max_host_gb);
  add_layer_options(sub, &o->layer, /*with_pow2_scales=*/true);
  return [o] { return run_bench(*o); };
}

}  // namespace megamoe::tool
