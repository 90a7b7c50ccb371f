// `megamoe check`: one forward per rank against the float64 reference, computed on the dequantised
// weights the layer computes with and on x as the layer consumed it; per-rank and overall rel-L2 and
// max abs error against the bound of the configuration's error model; PASS/FAIL (exit 1 on FAIL).
// The weights are a preset's random ones, or (--checkpoint DIR --layer L) layer L of a checkpoint as
// it ships, each rank loading its own experts, in the checkpoint's format unless --weight-format says.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "dump.h"
#include "megamoe/checkpoint.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "presets.h"
#include "ranks.h"
#include "reference_check.h"
#include "reference/error_model.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace megamoe::tool {
namespace {

struct CheckOptions {
  LayerOptions layer;
  std::string backend;
  std::string tokens = "64";
  std::string routing = "uniform";
  std::string seed = "1";
  std::string dump;
  std::string checkpoint;  // --checkpoint DIR
  std::string layer_index;  // --layer L
  bool weight_format_given = false;
  MaxHostGbOption max_host_gb;
};

// A checkpoint's status as a tool error: a file that cannot be read is an i/o failure, anything
// else a refused input.
ToolError checkpoint_error(const Status& st) {
  return ToolError(st.code() == StatusCode::kIoError ? kExitIo : kExitUsage, st.message());
}

// Rank r's experts of layer `layer` of the checkpoint in `dir`, loaded on rank r's thread.
RankWeightsFn checkpoint_weights(const std::string& dir, int64_t layer, const MoeGeometry& g) {
  return [dir, layer, g](int64_t r, RankWeights* out) -> Status {
    CheckpointExperts ex;
    MEGAMOE_RETURN_IF_ERROR(load_checkpoint_experts(dir, layer, g.ep_size, r, g.max_tokens_per_rank, &ex));
    out->views = ex.weights;
    out->storage = ex.storage;
    return Status::ok();
  };
}


int run_check(const CheckOptions& o) {
  const Backend backend = parse_backend_flag("--backend", o.backend);
  const int64_t tokens = parse_int_flag("--tokens", o.tokens, 0, 1 << 20);
  const int64_t max_tokens =
      o.layer.max_tokens.empty() ? tokens : parse_int_flag("--max-tokens", o.layer.max_tokens, 0, 1 << 20);
  if (max_tokens < tokens)
    throw ToolError(kExitUsage, "invalid value for --max-tokens: " + o.layer.max_tokens + ", must be at least --tokens=" +
                                    std::to_string(tokens) + " (the layer refuses a forward with T > max_tokens_per_rank)");
  const uint64_t seed = static_cast<uint64_t>(parse_int_flag("--seed", o.seed, 0, INT64_MAX));
  const reference::Routing routing = parse_routing_flag(o.routing);
  const HostMemoryLimit limit = host_memory_limit(o.max_host_gb);
  const bool from_checkpoint = !o.checkpoint.empty();
  if (from_checkpoint == !o.layer.preset.empty())
    throw ToolError(kExitUsage, from_checkpoint ? "--preset and --checkpoint exclude each other (the checkpoint's "
                                                  "config.json gives the geometry)"
                                                : "one of --preset P or --checkpoint DIR is required");
  if (from_checkpoint && (o.layer_index.empty() || !o.layer.experts.empty() || o.layer.pad))
    throw ToolError(kExitUsage, o.layer_index.empty() ? "--checkpoint needs --layer L (the MoE layer to load)"
                                                      : "--experts and --pad do not apply to --checkpoint (its "
                                                        "config.json gives the geometry)");
  if (!from_checkpoint && !o.layer_index.empty()) throw ToolError(kExitUsage, "--layer needs --checkpoint DIR");
  MoeGeometry g;
  MoeConfig c;
  int64_t layer = 0;
  CheckpointLayerInfo ckpt;
  if (from_checkpoint) {
    layer = parse_int_flag("--layer", o.layer_index, 0, 1 << 20);
    if (const Status st = probe_checkpoint_layer(o.checkpoint, layer, &ckpt); !st) throw checkpoint_error(st);
    g = ckpt.config.geometry(parse_int_flag("--ep", o.layer.ep, 1, 4096), 0, max_tokens);
    if (const Status st = g.validate(); !st)
      throw ToolError(kExitUsage, st.message() + " (geometry from " + o.checkpoint + "/config.json)");
    LayerOptions lo = o.layer;
    if (!o.weight_format_given) lo.weight_format = to_string(ckpt.format);
    c = make_config(lo, backend);
  } else {
    g = make_geometry(o.layer, max_tokens);
    c = make_config(o.layer, backend);
  }
  if (const Status st = c.validate(g); !st) throw ToolError(kExitUsage, st.message());
  const int64_t R = g.ep_size, H = g.hidden, I = g.intermediate, E = g.num_experts, k = g.top_k;

  if (from_checkpoint)
    std::printf("megamoe check: checkpoint %s, layer %lld, %s, backend %s\n  %s\n  %s\n", o.checkpoint.c_str(),
                static_cast<long long>(layer), to_string(ckpt.layout), to_string(backend), g.to_string().c_str(),
                c.to_string().c_str());
  else
    std::printf("megamoe check: preset %s%s, backend %s\n  %s\n  %s\n", o.layer.preset.c_str(),
                o.layer.pad ? " (padded)" : "", to_string(backend), g.to_string().c_str(), c.to_string().c_str());
  const RankWeightsFn weights_of =
      from_checkpoint ? checkpoint_weights(o.checkpoint, layer, g) : generated_weights(g, seed);
  std::printf("  routing %s, seed %llu, %lld tokens on each of %lld ranks\n", o.routing.c_str(),
              static_cast<unsigned long long>(seed), static_cast<long long>(tokens), static_cast<long long>(R));

  // The backend's gate first: a backend that cannot run is reported before any weights exist.
  const BackendSelection sel = select_backend(g, c);
  if (backend == Backend::kMega || backend == Backend::kRouted) {
    const Status gate = backend == Backend::kMega ? mega_capability(g, c) : routed_capability(g, c);
    if (!gate)
      throw ToolError(kExitUnavailable,
                      std::string("backend=") + to_string(backend) + " is unavailable: " + gate.message());
  }
  if (backend == Backend::kAuto) std::printf("  %s\n", sel.reason.c_str());
  ProcessRanks pr;
  if (const Status st = process_ranks(R, sel.backend == Backend::kRouted || sel.backend == Backend::kMega, &pr,
                                      o.layer.shared_gpu);
      !st)
    throw ToolError(st.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitUnavailable, st.message());
  if (pr.launched) {
    std::printf("  %s\n", pr.describe().c_str());
    if (!o.dump.empty())
      throw ToolError(kExitUsage, "--dump needs every rank in one process (run without megamoe launch)");
  }
  const std::vector<int64_t> tokens_per_rank(static_cast<size_t>(R), tokens);
  std::vector<DumpFile> plan;
  if (!o.dump.empty()) {
    plan = plan_dump(g, c, tokens_per_rank);
    const int64_t bytes = dump_bytes(plan);
    if (bytes > kMaxDumpBytes)
      throw ToolError(kExitUsage, "--dump would write " + format_bytes(bytes) + ", above the 4 GiB limit (" +
                                      format_bytes(kMaxDumpBytes) + "); use --experts N, fewer --tokens or a smaller preset");
  }
  auto estimate = [&](const MoeGeometry& gx) {
    return estimate_host_memory(gx, c, sel.backend, tokens, /*dequantised_copy=*/true);
  };
  const HostMemoryEstimate mem = estimate(g);
  if (!fits_host_memory(mem, limit))
    require_host_memory(mem, limit, o.layer.preset, experts_hint(g, limit, estimate));
  const reference::ErrorBound bound = reference::error_bound(c, k);

  // Inputs, layers (each rank generates its own slice of the weights on its own thread and frees it once
  // its layer has prepared its copy), one forward per rank.
  std::fprintf(stderr, "[check] generating inputs\n");
  std::vector<reference::RankInputs> inputs(static_cast<size_t>(R));
  const int input_threads = std::max<int>(1, reference::default_generate_threads() / static_cast<int>(R));
  Status st = run_on_local_ranks(pr, [&](int64_t r) {
    inputs[r] = reference::make_rank_inputs(g, seed, r, tokens, routing, input_threads);
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, "generating the inputs: " + st.message());
  RankGroup group;
  if (from_checkpoint)
    std::fprintf(stderr, "[check] building %lld layer(s): each rank loads its experts of layer %lld, then prepares %s\n",
                 static_cast<long long>(R), static_cast<long long>(layer), to_string(c.weight_format));
  else
    std::fprintf(stderr, "[check] building %lld layer(s): each rank generates its %s fp32 slice, then prepares %s\n",
                 static_cast<long long>(R), format_bytes(fp32_weight_bytes(g) / R).c_str(), to_string(c.weight_format));
  BuildTimes times;
  st = build_group(g, c, weights_of, &group, &times, &pr);
  if (!st) {
    if (from_checkpoint && st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kCudaError &&
        st.code() != StatusCode::kNcclError)
      throw checkpoint_error(st);
    throw ToolError(kExitUnavailable, st.message());
  }
  std::fprintf(stderr, "[check] layers built: source weights %.2f s, create (prepare + upload) %.2f s, warmup %.2f s\n",
               times.source_s, times.create_s, times.warmup_s);
  const MoeLayer* layer0 = first_local_layer(group);
  std::printf("  resolved backend: %s (%s)\n", to_string(layer0->backend()), layer0->selection().reason.c_str());

  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(R));
  std::vector<std::unique_ptr<RankIo>> io(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    const reference::RankInputs& in = inputs[r];
    io[r] = std::make_unique<RankIo>();
    st = io[r]->stage(group.layers[r]->device(), in.num_tokens, H, k, in.x_bf16.data(), in.topk_ids.data(),
                      in.topk_weights.data());
    if (!st) throw ToolError(kExitUnavailable, "rank " + std::to_string(r) + ": " + st.message());
    st = io[r]->poison_output();
    if (!st) throw ToolError(kExitUnavailable, st.message());
    y[r].assign(static_cast<size_t>(in.num_tokens * H), 0);
  }
  std::fprintf(stderr, "[check] forward on %lld rank(s)\n", static_cast<long long>(R));
  st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    void* stream = nullptr;
    MEGAMOE_RETURN_IF_ERROR(create_stream(group.layers[r]->device(), &stream));
    Status fst = io[r]->forward(group.layers[r].get(), stream);
    if (fst) fst = group.layers[r]->check_error(stream);  // synchronises; reports device-side failures
    if (fst) fst = io[r]->read_output(y[r].data());
    destroy_stream(group.layers[r]->device(), stream);
    if (!fst) return Status(fst.code(), "rank " + std::to_string(r) + " forward: " + fst.message());
    return fst;
  });
  if (!st) throw ToolError(kExitUnavailable, st.message());

  // The weights as the layer computes with them, all experts in global order. A launched process
  // holds one rank's layer: the other ranks' slices are generated and prepared here the same way
  // (the generator is per expert and the preparation deterministic, so the bits are the layers').
  std::fprintf(stderr, "[check] float64 reference\n");
  const int64_t El = g.experts_per_rank();
  std::vector<float> w13(static_cast<size_t>(E * 2 * I * H)), w2(static_cast<size_t>(E * H * I));
  st = run_on_ranks(R, [&](int64_t r) -> Status {
    PreparedWeights elsewhere;
    const PreparedWeights* pw = nullptr;
    if (pr.runs(r)) {
      pw = &group.layers[r]->prepared_weights();
    } else {
      RankWeights source;
      MEGAMOE_RETURN_IF_ERROR(weights_of(r, &source));
      MEGAMOE_RETURN_IF_ERROR(prepare_weights(g.for_rank(r), c, source.views, &elsewhere));
      pw = &elsewhere;
    }
    for (int64_t e = 0; e < El; ++e) {
      pw->w13.dequantize_expert(e, w13.data() + (r * El + e) * 2 * I * H);
      pw->w2.dequantize_expert(e, w2.data() + (r * El + e) * H * I);
    }
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, "the reference weights: " + st.message());
  std::vector<std::vector<float>> x(static_cast<size_t>(R));
  std::vector<ErrorSums> errors(static_cast<size_t>(R));
  st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    const reference::RankInputs& in = inputs[r];
    x[r] = consumed_x(c, in.x_bf16.data(), in.num_tokens, H);
    std::vector<double> ref(static_cast<size_t>(in.num_tokens * H));
    reference::reference_moe(g, in.num_tokens, x[r].data(), in.topk_ids.data(), in.topk_weights.data(), w13.data(),
                             w2.data(), ref.data());
    errors[r] = compare_output(y[r].data(), ref.data(), static_cast<int64_t>(y[r].size()));
    errors[r].tokens = in.num_tokens;
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, st.message());

  // Report.
  std::printf("  reference: float64 on the dequantised %s weights and x after the %s dispatch\n",
              to_string(c.weight_format), to_string(c.dispatch_format));
  std::printf("  bound: rel_l2 <= %.3g (%s)\n", bound.rel_l2, bound.derivation.c_str());
  std::printf("%-6s %8s %12s %12s %8s\n", "rank", "tokens", "rel_l2", "max_abs", "result");
  ErrorSums all;
  bool pass = true;
  nlohmann::json per_rank = nlohmann::json::array();
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;  // reported by its own process
    const ErrorSums& e = errors[r];
    const bool ok = e.non_finite == 0 && e.rel_l2() <= bound.rel_l2;
    pass = pass && ok;
    std::printf("%-6lld %8lld %12.4e %12.4e %8s", static_cast<long long>(r), static_cast<long long>(e.tokens),
                e.rel_l2(), e.max_abs, ok ? "PASS" : "FAIL");
    if (e.non_finite) std::printf("  (%lld non-finite outputs)", static_cast<long long>(e.non_finite));
    std::printf("\n");
    all.tokens += e.tokens;
    all.sum_sq_err += e.sum_sq_err;
    all.sum_sq_ref += e.sum_sq_ref;
    all.max_abs = std::max(all.max_abs, e.max_abs);
    all.non_finite += e.non_finite;
    per_rank.push_back({{"rank", r}, {"tokens", e.tokens}, {"rel_l2", e.rel_l2()}, {"max_abs", e.max_abs},
                        {"non_finite", e.non_finite}, {"pass", ok}});
  }
  pass = pass && all.non_finite == 0 && all.rel_l2() <= bound.rel_l2;
  std::printf("%s: rel_l2 %.4e, max_abs %.4e, bound rel_l2 <= %.3g: %s\n",
              pr.launched ? "this process" : "overall", all.rel_l2(), all.max_abs, bound.rel_l2, pass ? "PASS" : "FAIL");

  if (!o.dump.empty()) {
    DumpData data;
    data.w13_f32 = &w13;
    data.w2_f32 = &w2;
    for (int64_t r = 0; r < R; ++r) {
      const reference::RankInputs& in = inputs[r];
      data.prepared.push_back(&group.layers[r]->prepared_weights());
      data.x_bf16.push_back(&in.x_bf16);
      data.x_f32.push_back(&x[r]);
      data.topk_ids.push_back(&in.topk_ids);
      data.topk_weights.push_back(&in.topk_weights);
      data.y_bf16.push_back(&y[r]);
    }
    nlohmann::json meta;
    meta["tool"] = "megamoe check";
    meta["preset"] = o.layer.preset;
    if (from_checkpoint) meta["checkpoint"] = {{"dir", o.checkpoint}, {"layer", layer}, {"layout", to_string(ckpt.layout)}};
    meta["padded"] = o.layer.pad;
    meta["geometry"] = {{"hidden", H}, {"intermediate", I}, {"num_experts", E}, {"top_k", k}, {"ep_size", R},
                        {"max_tokens_per_rank", g.max_tokens_per_rank}};
    meta["config"] = {{"backend", to_string(backend)},
                      {"resolved_backend", to_string(group.layers[0]->backend())},
                      {"weight_format", to_string(c.weight_format)},
                      {"dispatch_format", to_string(c.dispatch_format)},
                      {"combine_dtype", to_string(c.combine_dtype)},
                      {"in_kernel_fc2_reduce", c.in_kernel_fc2_reduce},
                      {"owner_reduce", to_string(c.owner_reduce)},
                      {"owner_reduce_in_use", c.uses_owner_reduce()},
                      {"pow2_scales", c.pow2_scales}};
    meta["formats"] = {{"weight_format", to_string(c.weight_format)},
                       {"dispatch_format", to_string(c.dispatch_format)},
                       {"intermediate_format", to_string(c.intermediate_format())},
                       {"combine_dtype", to_string(c.combine_dtype)},
                       {"weight_data_dtype", to_string(group.layers[0]->prepared_weights().w13.data_dtype())},
                       {"weight_scale_dtype", c.weight_format == WeightFormat::kBf16
                                                  ? "none"
                                                  : to_string(group.layers[0]->prepared_weights().w13.scale_dtype())}};
    meta["seed"] = seed;
    meta["routing"] = o.routing;
    meta["tokens_per_rank"] = tokens_per_rank;
    meta["results"] = {{"ranks", per_rank},
                       {"rel_l2", all.rel_l2()},
                       {"max_abs", all.max_abs},
                       {"bound_rel_l2", bound.rel_l2},
                       {"pass", pass}};
    std::fprintf(stderr, "[check] writing %s to %s\n", format_bytes(dump_bytes(plan)).c_str(), o.dump.c_str());
    write_dump(o.dump, plan, data, meta);
    std::printf("dump: %s (meta.json and %zu .npy files)\n", o.dump.c_str(), plan.size());
  }
  return pass ? kExitOk : kExitCheckFailed;
}

}  // namespace

CommandRun add_check_command(CLI::App* app) {
  auto o = std::make_shared<CheckOptions>();
  CLI::App* sub = app->add_subcommand("check", "one forward per rank against the float64 reference; exit 1 when "
                                                "the error is above the bound");
  sub->add_option("--preset", o->layer.preset, "model preset: " + preset_names() + " (or --checkpoint)")->type_name("P");
  sub->add_option("--checkpoint", o->checkpoint,
                  "a Hugging Face checkpoint directory (config.json, *.safetensors): check layer --layer of it")
      ->type_name("DIR");
  sub->add_option("--layer", o->layer_index, "the MoE layer of --checkpoint")->type_name("L");
  sub->add_option("--backend", o->backend, "auto | mega | routed | cpu")->type_name("B")->required();
  sub->add_option("--tokens", o->tokens, "tokens on each rank")->type_name("T")->default_str(o->tokens);
  sub->add_option("--routing", o->routing, "uniform | single-expert | dropped")
      ->type_name("R")
      ->default_str(o->routing);
  sub->add_option("--seed", o->seed, "seed of the weights and inputs")->type_name("S")->default_str(o->seed);
  sub->add_option("--dump", o->dump, "write meta.json and .npy files of everything compared into DIR")
      ->type_name("DIR");
  add_max_host_gb_option(sub, &o->max_host_gb);
  add_layer_options(sub, &o->layer, /*with_pow2_scales=*/true);
  CLI::Option* weight_format = sub->get_option("--weight-format");
  return [o, weight_format] {
    o->weight_format_given = weight_format->count() > 0;
    return run_check(*o);
  };
}

}  // namespace megamoe::tool
