#include <doctest/doctest.h>
#include <signal.h>

#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "bootstrap/redis_fixture.h"

namespace ms::bootstrap {
using testing::RedisFixture;

namespace {

RankInfo Info(int rank, std::string host, int local = -1) {
  RankInfo me;
  me.rank = rank;
  me.hostname = std::move(host);
  me.local_rank = local;
  me.pid = 1000 + rank;
  me.address = "127.0.0.1";
  return me;
}

// Runs fn(rank, store) on one thread per rank, each with its own connection.
template <typename Fn>
void PerRank(const RedisFixture& fx, const std::string& job, int attempt, const std::vector<int>& ranks, Fn fn) {
  std::vector<std::thread> threads;
  for (int r : ranks) {
    threads.emplace_back([&, r] {
      auto s = ConnectRedisStore(fx.Options(job, attempt));
      if (!s.ok()) return;
      fn(r, **s);
    });
  }
  for (auto& t : threads) t.join();
}

std::vector<int> Iota(int n) {
  std::vector<int> v;
  for (int i = 0; i < n; ++i) v.push_back(i);
  return v;
}

}  // namespace

TEST_CASE("rendezvous derives hosts and local ranks; one global barrier") {
  RedisFixture fx;
  const int world = 16;
  ParallelGrid grid = *ParallelGrid::Make(world, 2, 2);
  std::mutex mu;
  std::map<int, Topology> topos;
  std::vector<std::string> errors;
  PerRank(fx, "rdv", 0, Iota(world), [&](int r, Store& s) {
    // host-b holds even ranks 8..15, host-a the rest; local ranks derived.
    auto t = Rendezvous(s, Info(r, r >= 8 ? "host-b" : "host-a"), world, grid, Millis(20000));
    std::lock_guard lock(mu);
    if (t.ok()) {
      topos[r] = *t;
      // register: compare-and-set + add; topology: one wait + one multi-get (the builder: more).
      CHECK(t->phases.size() == 2);
      CHECK(t->phases[0].ops == 2);
    } else {
      errors.push_back(t.status().ToString());
    }
  });
  REQUIRE_MESSAGE(errors.empty(), errors[0]);
  REQUIRE(topos.size() == world);
  for (auto& [r, t] : topos) {
    CHECK(t.num_hosts == 2);
    CHECK(t.host_index == (r >= 8 ? 1 : 0));
    CHECK(t.local_world == 8);
    CHECK(t.local_rank == r % 8);
    CHECK(t.host_ranks.front() == (r >= 8 ? 8 : 0));
    CHECK(t.grid.dp == 4);
  }
  auto reader = fx.Connect("rdv", 0);
  CHECK(*ReadHosts(*reader) == std::vector<std::string>{"host-a", "host-b"});
  auto regs = ReadRegistrations(*reader, world);
  REQUIRE(regs.ok());
  CHECK((*regs)[5].hostname == "host-a");
  CHECK((*regs)[12].pid == 1012);
}

TEST_CASE("rendezvous: claimed local ranks are kept and checked") {
  RedisFixture fx;
  ParallelGrid grid = *ParallelGrid::Make(4, 1, 1);
  std::mutex mu;
  std::map<int, Status> st;
  // Ranks 0 and 1 both claim local rank 0 on the same host: every rank gets the error.
  PerRank(fx, "dup-local", 0, Iota(4), [&](int r, Store& s) {
    auto t = Rendezvous(s, Info(r, "h", r == 1 ? 0 : r), 4, grid, Millis(10000));
    std::lock_guard lock(mu);
    st[r] = t.status();
  });
  for (auto& [r, s] : st) {
    CHECK(s.code() == Code::kInvalidArgument);
    CHECK(s.message().find("both say local rank 0") != std::string::npos);
  }
}

TEST_CASE("rendezvous errors: duplicate rank, mismatched layout, missing rank times out") {
  RedisFixture fx;
  ParallelGrid grid = *ParallelGrid::Make(4, 2, 1);
  SUBCASE("a rank registered twice") {
    auto a = fx.Connect("dup", 0);
    auto b = fx.Connect("dup", 0);
    CHECK(Rendezvous(*a, Info(3, "h"), 4, grid, Millis(100)).status().code() == Code::kTimeout);
    auto second = Rendezvous(*b, Info(3, "other-host"), 4, grid, Millis(100));
    REQUIRE_FALSE(second.ok());
    CHECK(second.status().code() == Code::kInvalidArgument);
    CHECK(second.status().message().find("rank 3 registered twice") != std::string::npos);
    CHECK(second.status().message().find("pid 1003 on h") != std::string::npos);
  }
  SUBCASE("a rank started with another layout fails every rank, fast") {
    std::mutex mu;
    std::vector<Status> st;
    double t0 = NowSeconds();
    PerRank(fx, "layout", 0, Iota(4), [&](int r, Store& s) {
      ParallelGrid g = r == 2 ? *ParallelGrid::Make(4, 4, 1) : grid;
      auto t = Rendezvous(s, Info(r, "h"), 4, g, Millis(20000));
      std::lock_guard lock(mu);
      st.push_back(t.status());
    });
    CHECK(NowSeconds() - t0 < 5.0);
    REQUIRE(st.size() == 4);
    for (auto& s : st) {
      CHECK(s.code() == Code::kInvalidArgument);
      CHECK(s.message().find("tp4.pp1.dp1") != std::string::npos);
    }
  }
  SUBCASE("a rank that never comes: timeout naming the barrier") {
    std::mutex mu;
    std::vector<Status> st;
    double t0 = NowSeconds();
    PerRank(fx, "missing", 0, {0, 1, 2}, [&](int r, Store& s) {
      auto t = Rendezvous(s, Info(r, "h"), 4, grid, Millis(500));
      std::lock_guard lock(mu);
      st.push_back(t.status());
    });
    double dt = NowSeconds() - t0;
    CHECK(dt < 3.0);
    for (auto& s : st) {
      CHECK(s.code() == Code::kTimeout);
      CHECK(s.message().find("waiting for all 4 ranks") != std::string::npos);
    }
  }
  SUBCASE("bad arguments") {
    auto s = fx.Connect("args", 0);
    CHECK(Rendezvous(*s, Info(4, "h"), 4, grid, Millis(100)).status().code() == Code::kInvalidArgument);
    CHECK(Rendezvous(*s, Info(0, "h"), 8, grid, Millis(100)).status().code() == Code::kInvalidArgument);
  }
}

TEST_CASE("stale keys of an earlier attempt are never read") {
  RedisFixture fx;
  ParallelGrid grid = *ParallelGrid::Make(4, 2, 1);
  {
    // Attempt 0 died half-way: two registrations, a count, and a poisoned topology.
    auto old = fx.Connect("job", 0);
    CHECK(old->CompareAndSet("reg/0", std::nullopt, "0\tdead-host\t0\t0\t1\t127.0.0.1\t4\ttp2.pp1.dp2").ok());
    CHECK(old->Add("reg/count", 3).ok());
    CHECK(old->Set("topo/done", "!stale topology of attempt 0").ok());
    CHECK(old->Set("group/tp/0/id", "stale-id").ok());
  }
  std::mutex mu;
  std::map<int, Topology> topos;
  std::map<int, std::string> tp_ids;
  PerRank(fx, "job", 1, Iota(4), [&](int r, Store& s) {
    auto t = Rendezvous(s, Info(r, "fresh-host"), 4, grid, Millis(10000));
    REQUIRE_MESSAGE(t.ok(), t.status().ToString());
    GroupExchangeOptions ex;
    ex.timeout = Millis(10000);
    auto ids = ExchangeGroupIds(s, grid, r, ex);
    REQUIRE_MESSAGE(ids.ok(), ids.status().ToString());
    std::lock_guard lock(mu);
    topos[r] = *t;
    tp_ids[r] = ids->id[static_cast<int>(GroupKind::kTp)];
  });
  REQUIRE(topos.size() == 4);
  for (auto& [r, t] : topos) CHECK((t.num_hosts == 1 && t.local_world == 4 && t.local_rank == r));
  CHECK(tp_ids[0] == tp_ids[1]);
  CHECK(tp_ids[0] != "stale-id");
  // Re-using attempt 0 would have failed: its keys are still there.
  auto again = fx.Connect("job", 0);
  CHECK(Rendezvous(*again, Info(0, "x"), 4, grid, Millis(100)).status().code() == Code::kInvalidArgument);
}

TEST_CASE("redis killed mid-bootstrap: every waiting rank fails clearly, no hang") {
  RedisFixture fx;
  ParallelGrid grid = *ParallelGrid::Make(8, 1, 1);
  const pid_t pid = fx.redis->pid();
  const int port = fx.redis->port();
  std::mutex mu;
  std::vector<Status> st;
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    kill(pid, SIGKILL);
  });
  double t0 = NowSeconds();
  PerRank(fx, "killed", 0, Iota(6), [&](int r, Store& s) {  // 6 of 8 ranks: they wait
    auto t = Rendezvous(s, Info(r, "h"), 8, grid, Millis(60000));
    std::lock_guard lock(mu);
    st.push_back(t.status());
  });
  double dt = NowSeconds() - t0;
  killer.join();
  CHECK(dt < 10.0);
  REQUIRE(st.size() == 6);
  for (auto& s : st) {
    CHECK(s.code() == Code::kUnavailable);
    CHECK(s.message().find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
  }
}

TEST_CASE("group ids: the leader publishes once, members read the same id; baseline agrees") {
  RedisFixture fx;
  const int world = 16;
  ParallelGrid grid = *ParallelGrid::Make(world, 2, 4);
  for (bool baseline : {false, true}) {
    CAPTURE(baseline);
    std::mutex mu;
    std::map<int, GroupIds> got;
    std::map<int, int> callbacks;
    PerRank(fx, baseline ? "ids-base" : "ids", 0, Iota(world), [&](int r, Store& s) {
      GroupExchangeOptions ex;
      ex.timeout = Millis(20000);
      ex.baseline = baseline;
      ex.id_bytes = 128;
      int calls = 0;
      ex.on_group = [&](GroupKind kind, int index, const std::vector<int>& members, const std::string& id) -> Status {
        CHECK(members == grid.Group(kind, r));
        CHECK(index == grid.GroupIndex(kind, r));
        CHECK(id.size() == (members.size() > 1 ? 128u : 0u));
        ++calls;
        return Status::Ok();
      };
      auto ids = ExchangeGroupIds(s, grid, r, ex);
      REQUIRE_MESSAGE(ids.ok(), ids.status().ToString());
      std::lock_guard lock(mu);
      got[r] = *ids;
      callbacks[r] = calls;
    });
    REQUIRE(got.size() == world);
    for (GroupKind kind : kAllGroupKinds) {
      std::set<std::string> distinct;
      for (auto& members : grid.AllGroups(kind)) {
        for (int m : members) CHECK(got[m].id[static_cast<int>(kind)] == got[members[0]].id[static_cast<int>(kind)]);
        if (members.size() > 1) CHECK(distinct.insert(got[members[0]].id[static_cast<int>(kind)]).second);
      }
    }
    for (int r = 0; r < world; ++r) {
      const bool in_embedding = !grid.EmbeddingGroup(r).empty();
      CHECK(callbacks[r] == (in_embedding ? 6 : 5));
    }
    if (!baseline) {
      // A member of 6 groups: <= 6 publishes + 2 ops (wait, get) per group it does not lead.
      int64_t ops = 0;
      for (auto& p : got[5].phases) ops += p.ops;
      CHECK(ops <= 2 * 6 * 2);
    } else {
      int total = 0;
      for (GroupKind k : kAllGroupKinds) total += grid.NumGroups(k);
      CHECK(got[0].baseline_groups_done == total);
    }
  }
}

}  // namespace ms::bootstrap
