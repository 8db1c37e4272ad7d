#include <doctest/doctest.h>

#include <map>
#include <set>

#include "parallel/parallel.h"

namespace ms::parallel {

// Simulates all ranks executing their schedules with blocking receives and asynchronous sends:
// returns false on deadlock. Also checks every (micro, chunk) runs forward then backward once.
bool Simulate(int pp, int v, int m) {
  std::vector<std::vector<Action>> sched(pp);
  for (int r = 0; r < pp; ++r) sched[r] = *PipelineSchedule(pp, r, v, m);
  const int G = pp * v;
  std::set<std::tuple<int, int, int>> done;  // (kind, micro, global chunk)
  std::vector<size_t> pc(pp, 0);
  bool progress = true;
  while (progress) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      while (pc[r] < sched[r].size()) {
        const Action& a = sched[r][pc[r]];
        const int g = a.chunk * pp + r;
        bool ready;
        if (a.kind == ActionKind::kForward) {
          ready = g == 0 || done.count({0, a.micro, g - 1});
        } else {
          ready = done.count({0, a.micro, g}) && (g == G - 1 || done.count({1, a.micro, g + 1}));
        }
        if (!ready) break;
        done.insert({a.kind == ActionKind::kForward ? 0 : 1, a.micro, g});
        ++pc[r];
        progress = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) {
    if (pc[r] != sched[r].size()) return false;
  }
  return done.size() == static_cast<size_t>(2 * m * G);
}

TEST_CASE("1F1B: warm-up, steady, cool-down") {
  auto s = *PipelineSchedule(4, 1, 1, 6);
  // rank 1 of 4: 2 warm-up forwards, then F/B alternating, then 2 backwards.
  std::vector<Action> want = {
      {ActionKind::kForward, 0, 0},  {ActionKind::kForward, 1, 0},  {ActionKind::kForward, 2, 0},
      {ActionKind::kBackward, 0, 0}, {ActionKind::kForward, 3, 0},  {ActionKind::kBackward, 1, 0},
      {ActionKind::kForward, 4, 0},  {ActionKind::kBackward, 2, 0}, {ActionKind::kForward, 5, 0},
      {ActionKind::kBackward, 3, 0}, {ActionKind::kBackward, 4, 0}, {ActionKind::kBackward, 5, 0}};
  CHECK(s == want);
  CHECK(MaxInFlight(s, 1) == 3);
  CHECK(MaxInFlight(*PipelineSchedule(4, 3, 1, 6), 1) == 1);  // last stage: 1F1B from the start
}

TEST_CASE("schedules are deadlock-free and complete") {
  for (int pp : {1, 2, 3, 4}) {
    for (int m : {1, 2, 3, 4, 5, 8}) {
      CAPTURE(pp);
      CAPTURE(m);
      CHECK(Simulate(pp, 1, m));
    }
    for (int v : {2, 3}) {
      for (int m : {pp, 2 * pp, 3 * pp}) {
        if (pp == 1) continue;
        CAPTURE(pp);
        CAPTURE(v);
        CAPTURE(m);
        CHECK(Simulate(pp, v, m));
      }
    }
  }
  CHECK_FALSE(PipelineSchedule(2, 0, 2, 3).ok());  // interleaving needs micro_batches % pp == 0
  CHECK_FALSE(PipelineSchedule(2, 2, 1, 3).ok());
}

}  // namespace ms::parallel
