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

namespace ms::parallel {

// The point-to-point plan for in-order communicators (NCCL): per ordered pair, the n-th send of the sender is
// the n-th receive of the receiver, and both are in the same round's group; every action's input is received
// in a round before the action's; every message appears once on each side.
TEST_CASE("PipelineP2pPlan: matched order per pair, same rounds, inputs before use") {
  for (int pp : {2, 3, 4}) {
    for (int v : {1, 2, 3}) {
      for (int m : {1, 2, 4, 6, 8}) {
        if (v > 1 && m % pp != 0) continue;
        CAPTURE(pp);
        CAPTURE(v);
        CAPTURE(m);
        std::vector<P2pPlan> plans;
        for (int r = 0; r < pp; ++r) {
          auto p = PipelineP2pPlan(pp, r, v, m);
          REQUIRE(p.ok());
          plans.push_back(*p);
        }
        // (from, to) -> sequence of (round, kind, micro, gchunk) as sent, and as received.
        std::map<std::pair<int, int>, std::vector<std::tuple<int, int, int, int>>> sent, received;
        for (int r = 0; r < pp; ++r) {
          for (size_t t = 0; t < plans[r].rounds.size(); ++t) {
            for (const P2pMessage& x : plans[r].rounds[t]) {
              auto key = x.send ? std::make_pair(r, x.peer) : std::make_pair(x.peer, r);
              (x.send ? sent : received)[key].emplace_back(static_cast<int>(t), x.kind, x.micro, x.gchunk);
            }
          }
        }
        CHECK(sent == received);
        size_t messages = 0;
        for (auto& [k, v2] : sent) messages += v2.size();
        CHECK(messages == static_cast<size_t>(2 * m * (pp * v - 1)));
        // Inputs: a forward of global chunk g > 0 needs (0, micro, g), a backward of g < G-1 needs (1, micro, g),
        // received in an earlier round than the action's.
        for (int r = 0; r < pp; ++r) {
          auto sched = *PipelineSchedule(pp, r, v, m);
          REQUIRE(plans[r].action_round.size() == sched.size());
          std::map<std::tuple<int, int, int>, int> got;  // message -> round received
          for (size_t t = 0; t < plans[r].rounds.size(); ++t) {
            for (const P2pMessage& x : plans[r].rounds[t]) {
              if (!x.send) got[{x.kind, x.micro, x.gchunk}] = static_cast<int>(t);
            }
          }
          for (size_t i = 0; i < sched.size(); ++i) {
            const int g = sched[i].chunk * pp + r, G = pp * v;
            const bool fwd = sched[i].kind == ActionKind::kForward;
            if ((fwd && g == 0) || (!fwd && g == G - 1)) continue;
            auto it = got.find({fwd ? 0 : 1, sched[i].micro, g});
            REQUIRE(it != got.end());
            CHECK(it->second < plans[r].action_round[i]);
          }
        }
      }
    }
  }
}

}  // namespace ms::parallel
