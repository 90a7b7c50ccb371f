// One group of layers per case, built from every rank's generated weights the first time and from
// the first case's prepared copy after that (bench's cases, tune's buckets), where the prepared
// format can be handed back bit for bit (reusable_source_format, presets.h).
#pragma once

#include <memory>
#include <vector>

#include "ranks.h"

namespace megamoe::tool {

// Every rank's prepared weights, kept after the first build for the later ones (empty: none kept).
using KeptWeights = std::vector<std::shared_ptr<const PreparedWeights>>;

// Builds a group for (g, c): from `kept` when it holds the weights, else generating each rank's slice
// (the seed's weights); then fills `kept` when it is empty and the format allows. Progress lines go
// to stderr with `tag` ("[bench]", "[tune]").
Status build_group_reusing(const MoeGeometry& g, const MoeConfig& c, uint64_t seed, const ProcessRanks& pr,
                           KeptWeights* kept, RankGroup* group, const char* tag);

}  // namespace megamoe::tool
