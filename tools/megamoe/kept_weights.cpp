// See kept_weights.h.
#include "kept_weights.h"

#include <cstdio>

#include "presets.h"

namespace megamoe::tool {
namespace {

// Whether `p` holds all of a rank's experts in `format` (a backend that released its host copy would
// leave it empty).
bool complete(const PreparedWeights& p, const MoeGeometry& g, WeightFormat format) {
  const int64_t El = g.experts_per_rank();
  auto whole = [El](const QuantizedTensor& t, int64_t rows, int64_t cols) {
    return t.num_experts == El && t.rows == rows && t.cols == cols &&
           static_cast<int64_t>(t.data.size()) == El * t.data_bytes_per_expert();
  };
  return p.format == format && whole(p.w13, 2 * g.intermediate, g.hidden) && whole(p.w2, g.hidden, g.intermediate);
}

}  // namespace

Status build_group_reusing(const MoeGeometry& g, const MoeConfig& c, uint64_t seed, const ProcessRanks& pr,
                           KeptWeights* kept, RankGroup* group, const char* tag) {
  const bool reuse = !kept->empty();
  RankWeightsFn source = generated_weights(g, seed);
  if (reuse)
    source = [kept](int64_t r, RankWeights* out) {
      out->views = source_views(*(*kept)[r]);
      out->storage = (*kept)[r];
      return Status::ok();
    };
  std::fprintf(stderr, "%s   building %lld layer(s): %s\n", tag, static_cast<long long>(g.ep_size),
               reuse ? "weights from the first case's prepared copy"
                     : ("each rank generates its " + format_bytes(fp32_weight_bytes(g) / g.ep_size) +
                        " fp32 slice, then prepares " + to_string(c.weight_format)).c_str());
  BuildTimes times;
  MEGAMOE_RETURN_IF_ERROR(build_group(g, c, source, group, &times, &pr));
  std::fprintf(stderr, "%s   layers built: source weights %.2f s, create (prepare + upload) %.2f s, warmup %.2f s\n",
               tag, times.source_s, times.create_s, times.warmup_s);
  if (reuse || !reusable_source_format(c.weight_format)) return Status::ok();
  KeptWeights copies(static_cast<size_t>(g.ep_size));
  const Status st = run_on_local_ranks(pr, [&](int64_t r) -> Status {
    const PreparedWeights& p = group->layers[r]->prepared_weights();
    if (complete(p, g, c.weight_format)) copies[r] = std::make_shared<const PreparedWeights>(p);
    return Status::ok();
  });
  if (!st) return Status::ok();  // no copy (out of memory): the later cases generate again
  for (int64_t r = 0; r < g.ep_size; ++r)
    if (pr.runs(r) && !copies[r]) return Status::ok();
  *kept = std::move(copies);
  return Status::ok();
}

}  // namespace megamoe::tool
