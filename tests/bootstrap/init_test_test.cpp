#include <doctest/doctest.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {

namespace {
// Runs a shell command, returns (exit code, stdout+stderr).
std::pair<int, std::string> Shell(const std::string& cmd) {
  std::string out;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  int rc = pclose(p);
  return {WEXITSTATUS(rc), out};
}
}  // namespace

TEST_CASE("init-test rejects bad arguments clearly") {
  InitTestOptions o;
  o.ranks = 0;
  CHECK(RunInitTest(o).status().message().find("--ranks must be >= 1") != std::string::npos);
  o.ranks = 12;
  o.tp = 8;
  auto r = RunInitTest(o);
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(r.status().message().find("does not divide the number of ranks 12") != std::string::npos);
  o.tp = 2;
  o.mode = "fast";
  CHECK(RunInitTest(o).status().code() == Code::kInvalidArgument);
  auto [rc, out] = Shell(std::string(BOOTSTRAP_CLI) + " init-test --ranks 12 --tp 5 -q");
  CHECK(rc == 1);
  CHECK(out.find("error: tp*pp = 5*1 = 5 does not divide the number of ranks 12") != std::string::npos);
  auto [rc2, out2] = Shell(std::string(BOOTSTRAP_CLI) + " init-test --ranks 8 --redis http://nope -q");
  CHECK(rc2 == 1);
  CHECK(out2.find("bad redis address") != std::string::npos);
}

TEST_CASE("simulated mode: both initializers, table and JSON") {
  InitTestOptions o;
  o.ranks = 256;
  o.tp = 4;
  o.pp = 4;
  o.progress = false;
  o.timeout = Millis(60000);
  o.json_path = (std::filesystem::temp_directory_path() / "ms-init-test.json").string();
  auto r = RunInitTest(o);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  REQUIRE(r->runs.size() == 2);
  const ModeReport& fast = r->runs[0];
  const ModeReport& base = r->runs[1];
  CHECK(fast.initializer == "megascale");
  CHECK(base.initializer == "baseline");
  std::vector<std::string> names;
  for (auto& p : fast.phases) names.push_back(p.name);
  CHECK(names == std::vector<std::string>{"connect", "register", "topology", "publish_ids", "tp", "pp", "dp",
                                          "embedding", "model_parallel", "world"});
  for (auto& p : fast.phases) {
    CAPTURE(p.name);
    CHECK(p.seconds >= 0);
    CHECK(p.ops > 0);
  }
  // connect: AUTH per rank; register: compare-and-set + add per rank.
  CHECK(fast.phases[0].ops == 256);
  CHECK(fast.phases[1].ops == 2 * 256);
  CHECK(fast.total.ops < 30 * 256);
  CHECK(base.total.ops > 5 * fast.total.ops);  // a barrier per group costs
  CHECK(fast.total.seconds > 0);
  std::string table = FormatTable(*r);
  CHECK(table.find("megascale   total") != std::string::npos);
  CHECK(table.find("baseline / megascale") != std::string::npos);
  auto json = ReadFile(o.json_path);
  REQUIRE(json.ok());
  CHECK(json->find(R"("initializer": "baseline")") != std::string::npos);
  CHECK(json->find(R"("phase": "model_parallel")") != std::string::npos);
  std::filesystem::remove(o.json_path);
}

TEST_CASE("real mode: 8 processes, tp2 pp2 dp2, Gloo groups with the right members and sums") {
  InitTestOptions o;
  o.ranks = 8;
  o.tp = 2;
  o.pp = 2;
  o.mode = "real";
  o.progress = false;
  o.timeout = Millis(60000);
  o.worker_command = {BOOTSTRAP_CLI, "init-test"};
  auto r = RunInitTest(o);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  REQUIRE(r->runs.size() == 2);
  // 6 groups per rank (with pp = 2 every rank is in an embedding group), 8 ranks, 2 initializers.
  CHECK(r->checks.size() == 2 * 8 * 6);
  ParallelGrid g = *ParallelGrid::Make(8, 2, 2);
  std::set<std::string> lines(r->checks.begin(), r->checks.end());
  for (const char* init : {"megascale", "baseline"}) {
    for (int rank = 0; rank < 8; ++rank) {
      for (GroupKind kind : kAllGroupKinds) {
        auto members = g.Group(kind, rank);
        int64_t sum = 0;
        for (int m : members) sum += m + 1;
        std::string want = fmt::format("{} rank {}: {}[{}] members {} sum {} ok", init, rank, GroupKindName(kind),
                                       g.GroupIndex(kind, rank), fmt::join(members, ","), sum);
        CHECK_MESSAGE(lines.count(want) == 1, want);
      }
    }
  }
  CHECK(r->runs[0].phases.back().name == "allreduce_check");
  CHECK(r->runs[0].total.ops > 0);
}

TEST_CASE("real mode through the command line, with an external redis URL via the environment") {
  auto redis = EmbeddedRedis::Start();
  REQUIRE(redis.ok());
  auto ep = *ParseRedisUrl(redis->url());
  ep.password = redis->password();
  const std::string json = (std::filesystem::temp_directory_path() / "ms-init-test-real.json").string();
  auto [rc, out] =
      Shell(fmt::format("MEGASCALE_REDIS_PASSWORD={} {} init-test --mode real --ranks 4 --tp 2 "
                        "--redis redis://127.0.0.1:{} --no-baseline --json {} --timeout 60",
                        ep.password, BOOTSTRAP_CLI, ep.port, json));
  CHECK_MESSAGE(rc == 0, out);
  CHECK(out.find("megascale   total") != std::string::npos);
  CHECK(out.find("all-reduce checks: 24 passed") != std::string::npos);
  CHECK(out.find(ep.password) == std::string::npos);
  CHECK(std::filesystem::exists(json));
  std::filesystem::remove(json);
}

}  // namespace ms::bootstrap
