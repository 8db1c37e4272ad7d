#include <doctest/doctest.h>

#include <set>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {

using V = std::vector<int>;

TEST_CASE("ParallelGrid::Make rejects bad layouts with clear errors") {
  auto zero = ParallelGrid::Make(0, 1, 1);
  REQUIRE_FALSE(zero.ok());
  CHECK(zero.status().code() == Code::kInvalidArgument);
  CHECK(zero.status().message().find(">= 1") != std::string::npos);
  auto bad = ParallelGrid::Make(12, 8, 1);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("does not divide the number of ranks 12") != std::string::npos);
  CHECK_FALSE(ParallelGrid::Make(16, 0, 2).ok());
  CHECK_FALSE(ParallelGrid::Make(16, 2, -1).ok());
  auto ok = ParallelGrid::Make(12288, 8, 8);
  REQUIRE(ok.ok());
  CHECK(ok->dp == 192);
  CHECK(ok->ToString() == "tp8.pp8.dp192");
}

TEST_CASE("the worked example of bootstrap.h") {
  ParallelGrid g = *ParallelGrid::Make(16, 2, 4);
  CHECK(g.dp == 2);
  CHECK(g.CoordsOf(13) == ParallelGrid::Coords{1, 2, 1});
  CHECK(g.RankOf({1, 2, 1}) == 13);
  CHECK(g.TpGroup(10) == V{10, 11});
  CHECK(g.PpGroup(9) == V{9, 11, 13, 15});
  CHECK(g.DpGroup(5) == V{5, 13});
  CHECK(g.EmbeddingGroup(14) == V{8, 14});
  CHECK(g.EmbeddingGroup(1) == V{1, 7});
  CHECK(g.EmbeddingGroup(4).empty());
  CHECK(g.GroupIndex(GroupKind::kEmbedding, 4) == -1);
  CHECK(g.ModelParallelGroup(9) == V{8, 9, 10, 11, 12, 13, 14, 15});
  CHECK(g.AllGroups(GroupKind::kEmbedding) == std::vector<V>{{0, 6}, {1, 7}, {8, 14}, {9, 15}});
  CHECK(g.AllGroups(GroupKind::kDp).size() == 8);
  CHECK(g.AllGroups(GroupKind::kTp)[5] == V{10, 11});
  ParallelGrid one = *ParallelGrid::Make(4, 2, 1);
  CHECK(one.EmbeddingGroup(3) == V{3});
  CHECK(one.NumGroups(GroupKind::kEmbedding) == 4);
}

TEST_CASE("groups partition the ranks and agree with the coordinates, for many layouts") {
  for (int world : {1, 2, 8, 12, 24, 48}) {
    for (int tp = 1; tp <= world; ++tp) {
      for (int pp = 1; pp <= world; ++pp) {
        auto made = ParallelGrid::Make(world, tp, pp);
        if (world % (tp * pp)) {
          CHECK_FALSE(made.ok());
          continue;
        }
        ParallelGrid g = *made;
        for (int r = 0; r < world; ++r) CHECK(g.RankOf(g.CoordsOf(r)) == r);
        for (GroupKind kind : kAllGroupKinds) {
          auto all = g.AllGroups(kind);
          CHECK(static_cast<int>(all.size()) == g.NumGroups(kind));
          std::set<int> seen;
          for (size_t i = 0; i < all.size(); ++i) {
            for (int r : all[i]) {
              CHECK(seen.insert(r).second);  // disjoint
              CHECK(g.GroupIndex(kind, r) == static_cast<int>(i));
              CHECK(g.Group(kind, r) == all[i]);
            }
          }
          if (kind != GroupKind::kEmbedding || pp <= 2) CHECK(static_cast<int>(seen.size()) == world);
        }
        for (int r = 0; r < world; ++r) {
          auto c = g.CoordsOf(r);
          for (int m : g.TpGroup(r)) CHECK((g.CoordsOf(m).pp == c.pp && g.CoordsOf(m).dp == c.dp));
          for (int m : g.PpGroup(r)) CHECK((g.CoordsOf(m).tp == c.tp && g.CoordsOf(m).dp == c.dp));
          for (int m : g.DpGroup(r)) CHECK((g.CoordsOf(m).tp == c.tp && g.CoordsOf(m).pp == c.pp));
          for (int m : g.ModelParallelGroup(r)) CHECK(g.CoordsOf(m).dp == c.dp);
          CHECK(static_cast<int>(g.TpGroup(r).size()) == tp);
          CHECK(static_cast<int>(g.PpGroup(r).size()) == pp);
          CHECK(static_cast<int>(g.DpGroup(r).size()) == g.dp);
        }
      }
    }
  }
}

}  // namespace ms::bootstrap
