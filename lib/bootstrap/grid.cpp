// ParallelGrid: the rank layout as pure arithmetic (see bootstrap.h for the worked example).
#include <fmt/format.h>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {

std::string_view GroupKindName(GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp:
      return "tp";
    case GroupKind::kPp:
      return "pp";
    case GroupKind::kDp:
      return "dp";
    case GroupKind::kEmbedding:
      return "embedding";
    case GroupKind::kModelParallel:
      return "model_parallel";
    case GroupKind::kWorld:
      return "world";
  }
  return "?";
}

Result<ParallelGrid> ParallelGrid::Make(int world, int tp, int pp) {
  if (world < 1) return InvalidArgument("the number of ranks must be >= 1, got {}", world);
  if (tp < 1) return InvalidArgument("tensor-parallel size (tp) must be >= 1, got {}", tp);
  if (pp < 1) return InvalidArgument("pipeline-parallel size (pp) must be >= 1, got {}", pp);
  if (world % (static_cast<int64_t>(tp) * pp) != 0) {
    return InvalidArgument("tp*pp = {}*{} = {} does not divide the number of ranks {} (world = tp*pp*dp)", tp, pp,
                           static_cast<int64_t>(tp) * pp, world);
  }
  ParallelGrid g;
  g.tp = tp;
  g.pp = pp;
  g.dp = world / (tp * pp);
  return g;
}

ParallelGrid::Coords ParallelGrid::CoordsOf(int rank) const {
  Coords c;
  c.tp = rank % tp;
  c.pp = (rank / tp) % pp;
  c.dp = rank / (tp * pp);
  return c;
}

std::vector<int> ParallelGrid::TpGroup(int rank) const {
  std::vector<int> out;
  const int base = rank - rank % tp;
  for (int i = 0; i < tp; ++i) out.push_back(base + i);
  return out;
}

std::vector<int> ParallelGrid::PpGroup(int rank) const {
  Coords c = CoordsOf(rank);
  std::vector<int> out;
  for (int p = 0; p < pp; ++p) out.push_back(RankOf({c.tp, p, c.dp}));
  return out;
}

std::vector<int> ParallelGrid::DpGroup(int rank) const {
  Coords c = CoordsOf(rank);
  std::vector<int> out;
  for (int d = 0; d < dp; ++d) out.push_back(RankOf({c.tp, c.pp, d}));
  return out;
}

std::vector<int> ParallelGrid::EmbeddingGroup(int rank) const {
  if (pp == 1) return {rank};
  Coords c = CoordsOf(rank);
  if (c.pp != 0 && c.pp != pp - 1) return {};
  return {RankOf({c.tp, 0, c.dp}), RankOf({c.tp, pp - 1, c.dp})};
}

std::vector<int> ParallelGrid::ModelParallelGroup(int rank) const {
  const int size = tp * pp;
  const int base = rank - rank % size;
  std::vector<int> out;
  for (int i = 0; i < size; ++i) out.push_back(base + i);
  return out;
}

std::vector<int> ParallelGrid::WorldGroup() const {
  std::vector<int> out;
  for (int r = 0; r < world(); ++r) out.push_back(r);
  return out;
}

std::vector<int> ParallelGrid::Group(GroupKind kind, int rank) const {
  switch (kind) {
    case GroupKind::kTp:
      return TpGroup(rank);
    case GroupKind::kPp:
      return PpGroup(rank);
    case GroupKind::kDp:
      return DpGroup(rank);
    case GroupKind::kEmbedding:
      return EmbeddingGroup(rank);
    case GroupKind::kModelParallel:
      return ModelParallelGroup(rank);
    case GroupKind::kWorld:
      return WorldGroup();
  }
  return {};
}

int ParallelGrid::GroupIndex(GroupKind kind, int rank) const {
  Coords c = CoordsOf(rank);
  switch (kind) {
    case GroupKind::kTp:
      return c.dp * pp + c.pp;
    case GroupKind::kPp:
      return c.dp * tp + c.tp;
    case GroupKind::kDp:
      return c.pp * tp + c.tp;
    case GroupKind::kEmbedding:
      if (pp == 1) return rank;
      if (c.pp != 0 && c.pp != pp - 1) return -1;
      return c.dp * tp + c.tp;
    case GroupKind::kModelParallel:
      return c.dp;
    case GroupKind::kWorld:
      return 0;
  }
  return -1;
}

int ParallelGrid::NumGroups(GroupKind kind) const {
  switch (kind) {
    case GroupKind::kTp:
      return pp * dp;
    case GroupKind::kPp:
      return tp * dp;
    case GroupKind::kDp:
      return tp * pp;
    case GroupKind::kEmbedding:
      return pp == 1 ? world() : tp * dp;
    case GroupKind::kModelParallel:
      return dp;
    case GroupKind::kWorld:
      return 1;
  }
  return 0;
}

std::vector<std::vector<int>> ParallelGrid::AllGroups(GroupKind kind) const {
  std::vector<std::vector<int>> out(NumGroups(kind));
  for (int r = 0; r < world(); ++r) {
    int g = GroupIndex(kind, r);
    if (g >= 0) out[g].push_back(r);
  }
  return out;
}

std::string ParallelGrid::ToString() const {
  return fmt::format("tp{}.pp{}.dp{}", tp, pp, dp);
}

}  // namespace ms::bootstrap
