// See tune_session.h.
#include "tune_session.h"

#include <algorithm>
#include <cstdio>

#include "reference/error_model.h"

namespace megamoe::tool {

Status ProcessAgreement::any(bool* flag) const {
  double v = *flag ? 1.0 : 0.0;
  MEGAMOE_RETURN_IF_ERROR(largest(&v));
  *flag = v > 0;
  return Status::ok();
}

Status ProcessAgreement::same(uint64_t fp, const std::string& what) const {
  double hi = static_cast<double>(fp), lo = -static_cast<double>(fp);
  MEGAMOE_RETURN_IF_ERROR(largest(&hi));
  MEGAMOE_RETURN_IF_ERROR(largest(&lo));  // minus the smallest
  const double mine = static_cast<double>(fp);
  if (hi == mine && -lo == mine) return Status::ok();
  const uint64_t other = static_cast<uint64_t>(hi != mine ? hi : -lo);
  return Status(StatusCode::kInvalidArgument, "the launched processes disagree on " + what + " (fingerprint " +
                                                  std::to_string(fp) + " here, " + std::to_string(other) +
                                                  " in another process): every process must run the same command");
}

uint64_t fingerprint(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h & ((uint64_t(1) << 52) - 1);
}

MoeConfig BucketLayers::config_of(const tune::Candidate& candidate) const {
  MoeConfig c = config_;
  c.backend = backend_;
  if (const auto it = shared_->hooks->stand_in.find(backend_); it != shared_->hooks->stand_in.end())
    c.backend = it->second;
  // Resolved here, so that a knob cache entry (apply_tuned_knobs) cannot change a candidate's layer.
  c.owner_reduce = candidate.owner_reduce != OwnerReduce::kAuto ? candidate.owner_reduce
                   : config_.uses_owner_reduce()                 ? OwnerReduce::kOn
                                                                 : OwnerReduce::kOff;
  c.knobs = Knobs();  // set per candidate (set_knobs), never from the knob cache
  return c;
}

Status BucketLayers::group_for(const tune::Candidate& candidate, Group** out) {
  std::unique_ptr<Group>& g = groups_[candidate.owner_reduce];
  if (!g) {
    auto fresh = std::make_unique<Group>();
    MEGAMOE_RETURN_IF_ERROR(build_group_reusing(geometry_, config_of(candidate), shared_->seed, *shared_->ranks,
                                                &shared_->kept, &fresh->layers, "[tune]"));
    MEGAMOE_RETURN_IF_ERROR(stage_case_io(*shared_->ranks, fresh->layers, *shared_->inputs,
                                          geometry_.max_tokens_per_rank, shared_->sets, &fresh->io));
    g = std::move(fresh);
  }
  *out = g.get();
  return Status::ok();
}

Status BucketLayers::set_knobs(Group& group, const tune::Candidate& candidate) {
  return run_on_local_ranks(*shared_->ranks,
                            [&](int64_t r) { return group.layers.layers[r]->set_knobs(candidate.knobs); });
}

Status BucketLayers::time_candidate(Group& group, const tune::Candidate& candidate,
                                    std::vector<std::vector<double>>* samples) {
  LockstepOptions o;
  o.warmup = shared_->warmup;
  o.iters = shared_->iters;
  const int64_t tokens = geometry_.max_tokens_per_rank;
  if (shared_->hooks->sample_us)
    o.sample_us = [&](int64_t rank, int64_t forward) {
      return shared_->hooks->sample_us(candidate, tokens, rank, forward - o.warmup);
    };
  LockstepTimes t;
  MEGAMOE_RETURN_IF_ERROR(time_lockstep_forwards(*shared_->ranks, group.layers, group.io, o, &t));
  samples->resize(t.us.size());
  for (size_t r = 0; r < t.us.size(); ++r)
    for (size_t it = static_cast<size_t>(o.warmup); it < t.us[r].size(); ++it) (*samples)[r].push_back(t.us[r][it]);
  return Status::ok();
}

Status BucketLayers::measure(const std::vector<tune::Candidate>& candidates, std::vector<double>* scores) {
  // [candidate][rank] -> every timed forward of every rep
  std::vector<std::vector<std::vector<double>>> samples(candidates.size());
  std::vector<bool> refused(candidates.size(), false);
  std::vector<Group*> groups(candidates.size(), nullptr);
  std::string labels;
  for (const tune::Candidate& c : candidates) labels += std::string(to_string(c.backend)) + " " + c.label() + ";";
  MEGAMOE_RETURN_IF_ERROR(shared_->processes.same(fingerprint(labels), "a stage's candidates"));
  for (size_t i = 0; i < candidates.size(); ++i) MEGAMOE_RETURN_IF_ERROR(group_for(candidates[i], &groups[i]));
  for (int64_t rep = 0; rep < shared_->reps; ++rep)
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (refused[i]) continue;
      // Knobs a layer refuses (Knobs::validate) are refused on every rank of this process alike;
      // launched, a refusal anywhere is one everywhere (the others would wait for it in lockstep).
      bool refuse = !set_knobs(*groups[i], candidates[i]);
      MEGAMOE_RETURN_IF_ERROR(shared_->processes.any(&refuse));
      if (refuse) {
        refused[i] = true;
        continue;
      }
      MEGAMOE_RETURN_IF_ERROR(time_candidate(*groups[i], candidates[i], &samples[i]));
      if (shared_->on_timing) shared_->on_timing(candidates[i].label());
    }
  scores->assign(candidates.size(), -1.0);
  for (size_t i = 0; i < candidates.size(); ++i) {
    std::vector<double> medians;
    for (const std::vector<double>& v : samples[i]) medians.push_back(v.empty() ? -1.0 : summarize(v).median);
    double score = refused[i] ? -1.0 : tune::slowest_rank_score(medians);
    MEGAMOE_RETURN_IF_ERROR(shared_->processes.largest(&score));
    (*scores)[i] = score;
  }
  return Status::ok();
}

Status BucketLayers::read_forward(Group& group, std::vector<std::vector<uint16_t>>* y) {
  const ProcessRanks& pr = *shared_->ranks;
  const int64_t R = geometry_.ep_size, T = geometry_.max_tokens_per_rank, H = geometry_.hidden;
  // Input set 0 into a poisoned output: a row the layer does not write fails as non-finite.
  CaseIo io;
  MEGAMOE_RETURN_IF_ERROR(stage_case_io(pr, group.layers, *shared_->inputs, T, 1, &io));
  y->assign(static_cast<size_t>(R), {});
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    MEGAMOE_RETURN_IF_ERROR(io[r][0]->poison_output());
    (*y)[r].assign(static_cast<size_t>(T * H), 0);
  }
  LockstepOptions o;
  o.iters = 1;
  o.after_forward = [&](int64_t r, int64_t) { return io[r][0]->read_output((*y)[r].data()); };
  LockstepTimes t;
  return time_lockstep_forwards(pr, group.layers, io, o, &t);
}

ExpertWeightsFn BucketLayers::expert_weights(const Group& group, const MoeConfig& c) const {
  const MoeGeometry g = geometry_;
  const uint64_t seed = shared_->seed;
  const RankGroup* layers = &group.layers;
  const ProcessRanks* pr = shared_->ranks;
  return [g, c, seed, layers, pr](int64_t e, float* w13, float* w2) -> Status {
    const int64_t El = g.experts_per_rank(), owner = e / El;
    if (pr->runs(owner)) {  // the owner's layer holds its prepared weights
      const PreparedWeights& p = layers->layers[owner]->prepared_weights();
      p.w13.dequantize_expert(e - owner * El, w13);
      p.w2.dequantize_expert(e - owner * El, w2);
      return Status::ok();
    }
    // Another process's expert: generated and prepared here (per expert, the same bits).
    MoeGeometry one = g;
    one.num_experts = 1;
    one.ep_size = 1;
    one.ep_rank = 0;
    const reference::ExpertWeights src = reference::make_expert_weights(g, seed, e, 1, 1);
    PreparedWeights p;
    MEGAMOE_RETURN_IF_ERROR(prepare_weights(one, c, src.view(), &p));
    p.w13.dequantize_expert(0, w13);
    p.w2.dequantize_expert(0, w2);
    return Status::ok();
  };
}

Status BucketLayers::verify(const tune::Candidate& candidate, VerifyResult* out) {
  *out = VerifyResult();
  Group* group = nullptr;
  MEGAMOE_RETURN_IF_ERROR(group_for(candidate, &group));
  MEGAMOE_RETURN_IF_ERROR(set_knobs(*group, candidate));
  std::vector<std::vector<uint16_t>> y;
  MEGAMOE_RETURN_IF_ERROR(read_forward(*group, &y));
  const MoeConfig c = config_of(candidate);
  const ProcessRanks& pr = *shared_->ranks;
  const int64_t H = geometry_.hidden;
  const std::vector<int64_t> rows = spread_rows(geometry_.max_tokens_per_rank, shared_->verify_tokens);
  ErrorSums all;
  for (int64_t r = 0; r < geometry_.ep_size; ++r) {
    if (!pr.runs(r)) continue;
    std::vector<double> ref;
    MEGAMOE_RETURN_IF_ERROR(reference_rows(geometry_, c, (*shared_->inputs)[r], rows, expert_weights(*group, c),
                                           reference::default_generate_threads(), &ref));
    std::vector<uint16_t> picked;
    for (int64_t t : rows) picked.insert(picked.end(), y[r].begin() + t * H, y[r].begin() + (t + 1) * H);
    ErrorSums e = compare_output(picked.data(), ref.data(), static_cast<int64_t>(picked.size()));
    e.tokens = static_cast<int64_t>(rows.size());
    all.add(e);
  }
  out->tokens = all.tokens;
  out->rel_l2 = all.rel_l2();
  out->bound = reference::error_bound(c, geometry_.top_k).rel_l2;
  out->pass = all.non_finite == 0 && out->rel_l2 <= out->bound;
  if (all.non_finite) out->detail = std::to_string(all.non_finite) + " non-finite outputs";
  else if (!out->pass) out->detail = "rel_l2 above the bound";
  bool failed = !out->pass;  // every process must pass
  MEGAMOE_RETURN_IF_ERROR(shared_->processes.any(&failed));
  if (failed && out->pass) {
    out->pass = false;
    out->detail = "another process's rank failed the check";
  }
  return Status::ok();
}

}  // namespace megamoe::tool
