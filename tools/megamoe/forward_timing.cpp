// See forward_timing.h.
#include "forward_timing.h"

#include <algorithm>
#include <atomic>

namespace megamoe::tool {

Status stage_case_io(const ProcessRanks& pr, const RankGroup& group, const std::vector<reference::RankInputs>& inputs,
                     int64_t tokens, int64_t sets, CaseIo* io) {
  const int64_t R = static_cast<int64_t>(group.layers.size());
  io->clear();
  io->resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    const MoeLayer& layer = *group.layers[r];
    const int64_t H = layer.geometry().hidden, k = layer.geometry().top_k;
    const reference::RankInputs& in = inputs[r];
    for (int64_t s = 0; s < sets; ++s) {
      const int64_t t0 = s * tokens;
      (*io)[r].push_back(std::make_unique<RankIo>());
      const Status st = (*io)[r][s]->stage(layer.device(), tokens, H, k, in.x_bf16.data() + t0 * H,
                                           in.topk_ids.data() + t0 * k, in.topk_weights.data() + t0 * k);
      if (!st) return Status(st.code(), "rank " + std::to_string(r) + ": " + st.message());
    }
  }
  return Status::ok();
}

std::vector<double> LockstepTimes::slowest_per_forward(bool sampled) const {
  std::vector<double> out;
  const int64_t R = static_cast<int64_t>(us.size());
  int64_t total = 0;
  for (const auto& v : us) total = std::max<int64_t>(total, static_cast<int64_t>(v.size()));
  for (int64_t it = warmup; it < total; ++it) {
    if (on_gpu || sampled) {
      double slowest = 0;
      for (int64_t r = 0; r < R; ++r)
        if (!us[r].empty()) slowest = std::max(slowest, us[r][it]);
      out.push_back(slowest);
      continue;
    }
    Clock::time_point first = Clock::time_point::max(), last = Clock::time_point::min();
    for (int64_t r = 0; r < R; ++r) {
      if (start[r].empty()) continue;
      first = std::min(first, start[r][it]);
      last = std::max(last, end[r][it]);
    }
    out.push_back(std::chrono::duration<double, std::micro>(last - first).count());
  }
  return out;
}

std::vector<double> LockstepTimes::rank_medians() const {
  std::vector<double> out;
  for (const auto& v : us) {
    if (v.empty()) {
      out.push_back(-1);
      continue;
    }
    out.push_back(summarize(std::vector<double>(v.begin() + std::min<int64_t>(warmup, v.size()), v.end())).median);
  }
  return out;
}

Status time_lockstep_forwards(const ProcessRanks& pr, RankGroup& group, CaseIo& io, const LockstepOptions& o,
                              LockstepTimes* out) {
  using Clock = LockstepTimes::Clock;
  const int64_t R = static_cast<int64_t>(group.layers.size());
  const int64_t total = o.warmup + o.iters;
  *out = LockstepTimes();
  out->warmup = o.warmup;
  out->on_gpu = first_local_layer(group)->device().kind == DeviceKind::kCuda;
  out->us.resize(static_cast<size_t>(R));
  out->start.resize(static_cast<size_t>(R));
  out->end.resize(static_cast<size_t>(R));
  for (int64_t r = 0; r < R; ++r) {
    if (!pr.runs(r)) continue;
    out->us[r].assign(static_cast<size_t>(total), 0.0);
    out->start[r].resize(static_cast<size_t>(total));
    out->end[r].resize(static_cast<size_t>(total));
  }
  RankBarrier barrier(pr, group);
  std::atomic<bool> failed{false};
  return run_on_local_ranks(pr, [&](int64_t r) -> Status {
    MoeLayer* layer = group.layers[r].get();
    const Device dev = layer->device();
    const int64_t sets = static_cast<int64_t>(io[r].size());
    void* stream = nullptr;
    Status rst = create_rank_stream(group, r, &stream);
    EventTimer timer;
    if (rst) rst = timer.init(dev);
    for (int64_t it = 0; it < total; ++it) {
      // Launched, each process has its own flag: a failed peer shows up in this rank's next forward
      // (a bounded transport wait), or megamoe launch stops the group when the peer exits.
      Status b = barrier.wait(r);
      if (!b) {
        rst = b;
        break;
      }
      if (failed.load()) break;  // every rank sees the same flag after the same barrier
      if (rst) rst = flush_l2(dev, stream, o.flush);
      if (rst) rst = synchronize(dev, stream);
      b = barrier.wait(r);  // every rank reaches it, failed or not (threads would wait otherwise)
      if (rst) rst = b;
      out->start[r][it] = Clock::now();
      if (rst) rst = timer.start(stream);
      if (rst) rst = o.run_forward ? o.run_forward(r, it, stream) : io[r][it % sets]->forward(layer, stream);
      if (rst) rst = timer.stop(stream);
      if (rst) rst = layer->check_error(stream);  // synchronises; reports device-side failures
      out->end[r][it] = Clock::now();
      double us = 0;
      if (rst) rst = timer.elapsed_us(&us);
      if (!out->on_gpu) us = std::chrono::duration<double, std::micro>(out->end[r][it] - out->start[r][it]).count();
      if (o.sample_us) us = o.sample_us(r, it);
      out->us[r][it] = us;
      if (rst && o.after_forward) rst = o.after_forward(r, it);
      if (!rst) failed.store(true);
      if (r == pr.first() && o.progress) o.progress(it + 1, total);
    }
    destroy_rank_stream(group, r, stream);
    if (!rst) return Status(rst.code(), "rank " + std::to_string(r) + " forward: " + rst.message());
    return rst;
  });
}

}  // namespace megamoe::tool
