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


// The flags resolved: what is checked (geometry, config, tokens, routing) and where the weights come from.
struct CheckCase {
  Backend backend = Backend::kAuto;
  int64_t tokens = 0;
  std::vector<int64_t> tokens_per_rank;
  uint64_t seed = 0;
  reference::Routing routing = reference::Routing::kUniform;
  HostMemoryLimit limit;
  bool from_checkpoint = false;
  int64_t layer = 0;  // --layer of --checkpoint
  CheckpointLayerInfo ckpt;
  MoeGeometry g;
  MoeConfig c;
};

CheckCase resolve_case(const CheckOptions& o) {
  CheckCase cc;
  cc.backend = parse_backend_flag("--backend", o.backend);
  cc.tokens = parse_int_flag("--tokens", o.tokens, 0, 1 << 20);
  const int64_t max_tokens =
      o.layer.max_tokens.empty() ? cc.tokens : parse_int_flag("--max-tokens", o.layer.max_tokens, 0, 1 << 20);
  if (max_tokens < cc.tokens)
    throw ToolError(kExitUsage, "invalid value for --max-tokens: " + o.layer.max_tokens + ", must be at least --tokens=" +
                                    std::to_string(cc.tokens) + " (the layer refuses a forward with T > max_tokens_per_rank)");
  cc.seed = static_cast<uint64_t>(parse_int_flag("--seed", o.seed, 0, INT64_MAX));
  cc.routing = parse_routing_flag(o.routing);
  cc.limit = host_memory_limit(o.max_host_gb);
  cc.from_checkpoint = !o.checkpoint.empty();
  if (cc.from_checkpoint == !o.layer.preset.empty())
    throw ToolError(kExitUsage, cc.from_checkpoint ? "--preset and --checkpoint exclude each other (the checkpoint's "
                                                     "config.json gives the geometry)"
                                                   : "one of --preset P or --checkpoint DIR is required");
  if (cc.from_checkpoint && (o.layer_index.empty() || !o.layer.experts.empty() || o.layer.pad))
    throw ToolError(kExitUsage, o.layer_index.empty() ? "--checkpoint needs --layer L (the MoE layer to load)"
                                                      : "--experts and --pad do not apply to --checkpoint (its "
                                                        "config.json gives the geometry)");
  if (!cc.from_checkpoint && !o.layer_index.empty()) throw ToolError(kExitUsage, "--layer needs --checkpoint DIR");
  if (cc.from_checkpoint) {
    cc.layer = parse_int_flag("--layer", o.layer_index, 0, 1 << 20);
    if (const Status st = probe_checkpoint_layer(o.checkpoint, cc.layer, &cc.ckpt); !st) throw checkpoint_error(st);
    cc.g = cc.ckpt.config.geometry(parse_int_flag("--ep", o.layer.ep, 1, 4096), 0, max_tokens);
    if (const Status st = cc.g.validate(); !st)
      throw ToolError(kExitUsage, st.message() + " (geometry from " + o.checkpoint + "/config.json)");
    LayerOptions lo = o.layer;
    if (!o.weight_format_given) lo.weight_format = to_string(cc.ckpt.format);
    cc.c = make_config(lo, cc.backend);
  } else {
    cc.g = make_geometry(o.layer, max_tokens);
    cc.c = make_config(o.layer, cc.backend);
  }
  if (const Status st = cc.c.validate(cc.g); !st) throw ToolError(kExitUsage, st.message());
  cc.tokens_per_rank.assign(static_cast<size_t>(cc.g.ep_size), cc.tokens);
  return cc;
}

void print_case(const CheckOptions& o, const CheckCase& cc) {
  if (cc.from_checkpoint)
    std::printf("megamoe check: checkpoint %s, layer %lld, %s, backend %s\n  %s\n  %s\n", o.checkpoint.c_str(),
                static_cast<long long>(cc.layer), to_string(cc.ckpt.layout), to_string(cc.backend),
                cc.g.to_string().c_str(), cc.c.to_string().c_str());
  else
    std::printf("megamoe check: preset %s%s, backend %s\n  %s\n  %s\n", o.layer.preset.c_str(),
                o.layer.pad ? " (padded)" : "", to_string(cc.backend), cc.g.to_string().c_str(),
                cc.c.to_string().c_str());
  std::printf("  routing %s, seed %llu, %lld tokens on each of %lld ranks\n", o.routing.c_str(),
              static_cast<unsigned long long>(cc.seed), static_cast<long long>(cc.tokens),
              static_cast<long long>(cc.g.ep_size));
}

// The backend's gate, the ranks this process runs and the limits (the dump's size, host memory),
// all before any weights exist. Returns the ranks; *dump_plan: the files --dump writes.
ProcessRanks plan_ranks(const CheckOptions& o, const CheckCase& cc, BackendSelection* sel,
                        std::vector<DumpFile>* dump_plan) {
  *sel = select_backend(cc.g, cc.c);
  if (cc.backend == Backend::kMega || cc.backend == Backend::kRouted) {
    const Status gate = cc.backend == Backend::kMega ? mega_capability(cc.g, cc.c) : routed_capability(cc.g, cc.c);
    if (!gate)
      throw ToolError(kExitUnavailable,
                      std::string("backend=") + to_string(cc.backend) + " is unavailable: " + gate.message());
  }
  if (cc.backend == Backend::kAuto) std::printf("  %s\n", sel->reason.c_str());
  ProcessRanks pr;
  if (const Status st = process_ranks(cc.g.ep_size, sel->backend == Backend::kRouted || sel->backend == Backend::kMega,
                                      &pr, o.layer.shared_gpu);
      !st)
    throw ToolError(st.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitUnavailable, st.message());
  if (pr.launched) {
    std::printf("  %s\n", pr.describe().c_str());
    if (!o.dump.empty())
      throw ToolError(kExitUsage, "--dump needs every rank in one process (run without megamoe launch)");
  }
  if (!o.dump.empty()) {
    *dump_plan = plan_dump(cc.g, cc.c, cc.tokens_per_rank);
    const int64_t bytes = dump_bytes(*dump_plan);
    if (bytes > kMaxDumpBytes)
      throw ToolError(kExitUsage, "--dump would write " + format_bytes(bytes) + ", above the 4 GiB limit (" +
                                      format_bytes(kMaxDumpBytes) + "); use --experts N, fewer --tokens or a smaller preset");
  }
  auto estimate = [&](const MoeGeometry& gx) {
    return estimate_host_memory(gx, cc.c, sel->backend, cc.tokens, /*dequantised_copy=*/true);
  };
  const HostMemoryEstimate mem = estimate(cc.g);
  if (!fits_host_memory(mem, cc.limit))
    require_host_memory(mem, cc.limit, o.layer.preset, experts_hint(cc.g, cc.limit, estimate));
  return pr;
}

// Each local rank's inputs, generated on its own thread.
std::vector<reference::RankInputs> generate_inputs(const ProcessRanks& pr, const CheckCase& cc) {
  std::fprintf(stderr, "[check] generating inputs\n");
  const int64_t R = cc.g.ep_size;
  std::vector<reference::RankInputs> inputs(static_cast<size_t>(R));
  const int input_threads = std::max<int>(1, reference::default_generate_threads() / static_cast<int>(R));
  const Status st = run_on_local_ranks(pr, [&](int64_t r) {
    inputs[r] = reference::make_rank_inputs(cc.g, cc.seed, r, cc.tokens, cc.routing, input_threads);
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, "generating the inputs: " + st.message());
  return inputs;
}

// The local ranks' layers: each rank sources its slice of the weights on its own thread and frees
// it once its layer has prepared its copy.
void build_layers(const ProcessRanks& pr, const CheckCase& cc, const RankWeightsFn& weights_of, RankGroup* group) {
  const int64_t R = cc.g.ep_size;
  if (cc.from_checkpoint)
    std::fprintf(stderr, "[check] building %lld layer(s): each rank loads its experts of layer %lld, then prepares %s\n",
                 static_cast<long long>(R), static_cast<long long>(cc.layer), to_string(cc.c.weight_format));
  else
    std::fprintf(stderr, "[check] building %lld layer(s): each rank generates its %s fp32 slice, then prepares %s\n",
                 static_cast<long long>(R), format_bytes(fp32_weight_bytes(cc.g) / R).c_str(),
                 to_string(cc.c.weight_format));
  BuildTimes times;
  const Status st = build_group(cc.g, cc.c, weights_of, group, &times, &pr);
  if (!st) {
    if (cc.from_checkpoint && st.code() != StatusCode::kUnavailable && st.code() != StatusCode::kCudaError &&
        st.code() != StatusCode::kNcclError)
      throw checkpoint_error(st);
    throw ToolError(kExitUnavailable, st.message());
  }
  std::fprintf(stderr, "[check] layers built: source weights %.2f s, create (prepare + upload) %.2f s, warmup %.2f s\n",
               times.source_s, times.create_s, times.warmup_s);
  const MoeLayer* layer0 = first_local_layer(*group);
  std::printf("  resolved backend: %s (%s)\n", to_string(layer0->backend()), layer0->selection().reason.c_str());
}

// One forward per local rank (output poisoned first); returns each local rank's y (bf16 codes).
std::vector<std::vector<uint16_t>> run_forwards(const ProcessRanks& pr, const CheckCase& cc, const RankGroup& group,
                                                const std::vector<reference::RankInputs>& inputs) {
  const int64_t R = cc.g.ep_size, H = cc.g.hidden;
  std::vector<std::vector<uint16_t>> y(static_cast<size_t>(R));
  std::vector<std::unique_ptr<RankIo>> io(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    const reference::RankInputs& in = inputs[r];
    io[r] = std::make_unique<RankIo>();
    Status st = io[r]->stage(group.layers[r]->device(), in.num_tokens, H, cc.g.top_k, in.x_bf16.data(),
                             in.topk_ids.data(), in.topk_weights.data());
    if (!st) throw ToolError(kExitUnavailable, "rank " + std::to_string(r) + ": " + st.message());
    st = io[r]->poison_output();
    if (!st) throw ToolError(kExitUnavailable, st.message());
    y[r].assign(static_cast<size_t>(in.num_tokens * H), 0);
  }
  std::fprintf(stderr, "[check] forward on %lld rank(s)\n", static_cast<long long>(R));
  const Status st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    void* stream = nullptr;
    MEGAMOE_RETURN_IF_ERROR(create_rank_stream(group, r, &stream));
    Status fst = io[r]->forward(group.layers[r].get(), stream);
    if (fst) fst = group.layers[r]->check_error(stream);  // synchronises; reports device-side failures
    if (fst) fst = io[r]->read_output(y[r].data());
    destroy_rank_stream(group, r, stream);
    if (!fst) return Status(fst.code(), "rank " + std::to_string(r) + " forward: " + fst.message());
    return fst;
  });
  if (!st) throw ToolError(kExitUnavailable, st.message());
  return y;
}

// The weights as the layer computes with them, all experts in global order, dequantised. A launched
// process holds one rank's layer: the other ranks' slices are sourced and prepared here the same way
// (the generator is per expert and the preparation deterministic, so the bits are the layers').
void reference_weights(const ProcessRanks& pr, const CheckCase& cc, const RankGroup& group,
                       const RankWeightsFn& weights_of, std::vector<float>* w13, std::vector<float>* w2) {
  const MoeGeometry& g = cc.g;
  const int64_t H = g.hidden, I = g.intermediate, El = g.experts_per_rank();
  w13->assign(static_cast<size_t>(g.num_experts * 2 * I * H), 0.f);
  w2->assign(static_cast<size_t>(g.num_experts * H * I), 0.f);
  const Status st = run_on_ranks(g.ep_size, [&](int64_t r) -> Status {
    PreparedWeights elsewhere;
    const PreparedWeights* pw = nullptr;
    if (pr.runs(r)) {
      pw = &group.layers[r]->prepared_weights();
    } else {
      RankWeights source;
      MEGAMOE_RETURN_IF_ERROR(weights_of(r, &source));
      MEGAMOE_RETURN_IF_ERROR(prepare_weights(g.for_rank(r), cc.c, source.views, &elsewhere));
      pw = &elsewhere;
    }
    for (int64_t e = 0; e < El; ++e) {
      pw->w13.dequantize_expert(e, w13->data() + (r * El + e) * 2 * I * H);
      pw->w2.dequantize_expert(e, w2->data() + (r * El + e) * H * I);
    }
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, "the reference weights: " + st.message());
}

// Each local rank's y against the float64 reference on x as the layer consumed it (*x: those x).
std::vector<ErrorSums> compare_ranks(const ProcessRanks& pr, const CheckCase& cc,
                                     const std::vector<reference::RankInputs>& inputs,
                                     const std::vector<std::vector<uint16_t>>& y, const std::vector<float>& w13,
                                     const std::vector<float>& w2, std::vector<std::vector<float>>* x) {
  const int64_t R = cc.g.ep_size, H = cc.g.hidden;
  x->assign(static_cast<size_t>(R), {});
  std::vector<ErrorSums> errors(static_cast<size_t>(R));
  const Status st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    const reference::RankInputs& in = inputs[r];
    (*x)[r] = consumed_x(cc.c, in.x_bf16.data(), in.num_tokens, H);
    std::vector<double> ref(static_cast<size_t>(in.num_tokens * H));
    reference::reference_moe(cc.g, in.num_tokens, (*x)[r].data(), in.topk_ids.data(), in.topk_weights.data(),
                             w13.data(), w2.data(), ref.data());
    errors[r] = compare_output(y[r].data(), ref.data(), static_cast<int64_t>(y[r].size()));
    errors[r].tokens = in.num_tokens;
    return Status::ok();
  });
  if (!st) throw ToolError(kExitUnavailable, st.message());
  return errors;
}

struct CheckReport {
  ErrorSums all;  // this process's ranks together
  bool pass = true;
  nlohmann::json per_rank = nlohmann::json::array();
};

// The table of the local ranks' errors against the bound, and the verdict.
CheckReport report(const ProcessRanks& pr, const CheckCase& cc, const reference::ErrorBound& bound,
                   const std::vector<ErrorSums>& errors) {
  std::printf("  reference: float64 on the dequantised %s weights and x after the %s dispatch\n",
              to_string(cc.c.weight_format), to_string(cc.c.dispatch_format));
  std::printf("  bound: rel_l2 <= %.3g (%s)\n", bound.rel_l2, bound.derivation.c_str());
  std::printf("%-6s %8s %12s %12s %8s\n", "rank", "tokens", "rel_l2", "max_abs", "result");
  CheckReport rep;
  ErrorSums& all = rep.all;
  for (int64_t r = 0; r < cc.g.ep_size; ++r) {
    if (!pr.runs(r)) continue;  // reported by its own process
    const ErrorSums& e = errors[r];
    const bool ok = e.non_finite == 0 && e.rel_l2() <= bound.rel_l2;
    rep.pass = rep.pass && ok;
    std::printf("%-6lld %8lld %12.4e %12.4e %8s", static_cast<long long>(r), static_cast<long long>(e.tokens),
                e.rel_l2(), e.max_abs, ok ? "PASS" : "FAIL");
    if (e.non_finite) std::printf("  (%lld non-finite outputs)", static_cast<long long>(e.non_finite));
    std::printf("\n");
    all.tokens += e.tokens;
    all.sum_sq_err += e.sum_sq_err;
    all.sum_sq_ref += e.sum_sq_ref;
    all.max_abs = std::max(all.max_abs, e.max_abs);
    all.non_finite += e.non_finite;
    rep.per_rank.push_back({{"rank", r}, {"tokens", e.tokens}, {"rel_l2", e.rel_l2()}, {"max_abs", e.max_abs},
                            {"non_finite", e.non_finite}, {"pass", ok}});
  }
  rep.pass = rep.pass && all.non_finite == 0 && all.rel_l2() <= bound.rel_l2;
  std::printf("%s: rel_l2 %.4e, max_abs %.4e, bound rel_l2 <= %.3g: %s\n", pr.launched ? "this process" : "overall",
              all.rel_l2(), all.max_abs, bound.rel_l2, rep.pass ? "PASS" : "FAIL");
  return rep;
}

// --dump's meta.json: the case, the formats as the layer holds them, the results.
nlohmann::json dump_meta(const CheckOptions& o, const CheckCase& cc, const RankGroup& group,
                         const reference::ErrorBound& bound, const CheckReport& rep) {
  const MoeGeometry& g = cc.g;
  const MoeConfig& c = cc.c;
  const PreparedWeights& pw0 = group.layers[0]->prepared_weights();
  nlohmann::json meta;
  meta["tool"] = "megamoe check";
  meta["preset"] = o.layer.preset;
  if (cc.from_checkpoint)
    meta["checkpoint"] = {{"dir", o.checkpoint}, {"layer", cc.layer}, {"layout", to_string(cc.ckpt.layout)}};
  meta["padded"] = o.layer.pad;
  meta["geometry"] = {{"hidden", g.hidden}, {"intermediate", g.intermediate}, {"num_experts", g.num_experts},
                      {"top_k", g.top_k}, {"ep_size", g.ep_size}, {"max_tokens_per_rank", g.max_tokens_per_rank}};
  meta["config"] = {{"backend", to_string(cc.backend)},
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
                     {"weight_data_dtype", to_string(pw0.w13.data_dtype())},
                     {"weight_scale_dtype",
                      c.weight_format == WeightFormat::kBf16 ? "none" : to_string(pw0.w13.scale_dtype())}};
  meta["seed"] = cc.seed;
  meta["routing"] = o.routing;
  meta["tokens_per_rank"] = cc.tokens_per_rank;
  meta["results"] = {{"ranks", rep.per_rank},
                     {"rel_l2", rep.all.rel_l2()},
                     {"max_abs", rep.all.max_abs},
                     {"bound_rel_l2", bound.rel_l2},
                     {"pass", rep.pass}};
  return meta;
}

int run_check(const CheckOptions& o) {
  const CheckCase cc = resolve_case(o);
  print_case(o, cc);
  const RankWeightsFn weights_of =
      cc.from_checkpoint ? checkpoint_weights(o.checkpoint, cc.layer, cc.g) : generated_weights(cc.g, cc.seed);
  BackendSelection sel;
  std::vector<DumpFile> dump_plan;
  const ProcessRanks pr = plan_ranks(o, cc, &sel, &dump_plan);
  const reference::ErrorBound bound = reference::error_bound(cc.c, cc.g.top_k);

  const std::vector<reference::RankInputs> inputs = generate_inputs(pr, cc);
  RankGroup group;
  build_layers(pr, cc, weights_of, &group);
  std::vector<std::vector<uint16_t>> y = run_forwards(pr, cc, group, inputs);

  std::fprintf(stderr, "[check] float64 reference\n");
  std::vector<float> w13, w2;
  reference_weights(pr, cc, group, weights_of, &w13, &w2);
  std::vector<std::vector<float>> x;
  const std::vector<ErrorSums> errors = compare_ranks(pr, cc, inputs, y, w13, w2, &x);
  const CheckReport rep = report(pr, cc, bound, errors);

  if (!o.dump.empty()) {
    DumpData data;
    data.w13_f32 = &w13;
    data.w2_f32 = &w2;
    for (int64_t r = 0; r < cc.g.ep_size; ++r) {
      const reference::RankInputs& in = inputs[r];
      data.prepared.push_back(&group.layers[r]->prepared_weights());
      data.x_bf16.push_back(&in.x_bf16);
      data.x_f32.push_back(&x[r]);
      data.topk_ids.push_back(&in.topk_ids);
      data.topk_weights.push_back(&in.topk_weights);
      data.y_bf16.push_back(&y[r]);
    }
    std::fprintf(stderr, "[check] writing %s to %s\n", format_bytes(dump_bytes(dump_plan)).c_str(), o.dump.c_str());
    write_dump(o.dump, dump_plan, data, dump_meta(o, cc, group, bound, rep));
    std::printf("dump: %s (meta.json and %zu .npy files)\n", o.dump.c_str(), dump_plan.size());
  }
  return rep.pass ? kExitOk : kExitCheckFailed;
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
