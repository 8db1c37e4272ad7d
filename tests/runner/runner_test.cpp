// Unit tests of the runner's internals: the spawn of a rank, the GPU a rank drives, the
// checkpoint coordinator's locking, waits on one rank through the store, and the run-directory lock.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "bootstrap/redis_fixture.h"
#include "checkpoint/checkpoint.h"
#include "runner/attempt.h"
#include "runner/checkpointing.h"
#include "runner/driver.h"
#include "runner/heartbeat.h"
#include "runner/monitor.h"
#include "runner/rank.h"
#include "runner/run_dir.h"
#include "runner/runner.h"
#include "runner/self_check.h"

namespace ms::runner {
namespace {

// Waits up to `seconds` for the child; its wait status, or nullopt if it is still running.
std::optional<int> WaitFor(pid_t pid, double seconds) {
  const double deadline = NowSeconds() + seconds;
  while (NowSeconds() < deadline) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return std::nullopt;
}

std::string TempDir(const char* name) {
  auto d = std::filesystem::temp_directory_path() / fmt::format("ms-runner-{}-{}", name, getpid());
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace

TEST_CASE("a rank drives the GPU of its local rank, whatever the placement") {
  // Cyclic placement over two hosts: ranks 0 and 2 on host A, 1 and 3 on host B. rank % local_world
  // would put ranks 0 and 2 both on GPU 0 of host A.
  Runtime rt;
  rt.rank = 2;
  rt.world = 4;
  rt.host.local_rank = 1;
  rt.host.local_world = 2;
  CHECK(DeviceOrdinal(rt) == 1);
  rt.rank = 0;
  rt.host.local_rank = 0;
  CHECK(DeviceOrdinal(rt) == 0);
}

TEST_CASE("a spawned rank whose parent is not the expected one exits at once") {
  // The parent may die between fork() and PR_SET_PDEATHSIG: the child must notice (getppid() is
  // then another process) instead of running on as an orphan. Simulated with a wrong parent pid.
  SpawnSpec s;
  s.argv = {"/bin/sleep", "30"};
  s.env = MergedEnvironment({});
  s.parent_pid = getpid() + 100000;  // not our pid
  auto pid = Spawn(s);
  REQUIRE(pid.ok());
  auto status = WaitFor(*pid, 5);
  if (!status) kill(*pid, SIGKILL);
  REQUIRE(status.has_value());
  CHECK(WIFEXITED(*status));
  CHECK(WEXITSTATUS(*status) == 127);
  // The right parent: it runs.
  s.parent_pid = 0;
  s.argv = {"/bin/true"};
  pid = Spawn(s);
  REQUIRE(pid.ok());
  status = WaitFor(*pid, 5);
  REQUIRE(status.has_value());
  CHECK(WEXITSTATUS(*status) == 0);
}

TEST_CASE("a spawned rank starts with the stop signals blocked, so an early signal does not kill it") {
  SpawnSpec s;
  s.argv = {"/bin/sleep", "30"};
  s.env = MergedEnvironment({});
  auto pid = Spawn(s);
  REQUIRE(pid.ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (int sig : {SIGTERM, SIGUSR1, SIGINT}) REQUIRE(kill(*pid, sig) == 0);
  CHECK_FALSE(WaitFor(*pid, 0.3).has_value());  // still running: the signals are pending
  kill(*pid, SIGKILL);
  CHECK(WaitFor(*pid, 5).has_value());
}

TEST_CASE("a job's process survives a write to a dead peer, and the programs it starts get SIGPIPE back") {
  // A rank whose data-parallel peer was killed wrote to the broken socket and died by SIGPIPE, so
  // the driver sometimes blamed it for the crash (the layout-equivalence test's killed rank, about
  // one run in five). In a child, since InstallStopSignals changes the process's signal state.
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    InstallStopSignals();
    int fds[2];
    if (pipe(fds) != 0) _exit(10);
    close(fds[0]);
    const bool epipe = write(fds[1], "x", 1) < 0 && errno == EPIPE;  // the process is still alive
    // A spawned program must not inherit the ignored SIGPIPE (SIG_IGN survives exec): `yes` writing
    // into the same broken pipe dies by it.
    SpawnSpec s;
    s.argv = {"/usr/bin/yes"};
    s.env = MergedEnvironment({});
    s.stdout_fd = fds[1];
    auto pid = Spawn(s);
    if (!pid.ok()) _exit(11);
    int status = 0;
    if (waitpid(*pid, &status, 0) != *pid) _exit(12);
    const bool spawned_default = WIFSIGNALED(status) && WTERMSIG(status) == SIGPIPE;
    _exit(epipe ? (spawned_default ? 0 : 3) : 2);
  }
  auto status = WaitFor(child, 10);
  if (!status) kill(child, SIGKILL);
  REQUIRE(status.has_value());
  INFO("2: the write killed the process or did not fail with EPIPE; 3: the spawned program ignored SIGPIPE");
  REQUIRE(WIFEXITED(*status));  // not killed by SIGPIPE
  CHECK(WEXITSTATUS(*status) == 0);
}

TEST_CASE("the checkpoint coordinator never makes a mark wait behind rank 0's wait") {
  bootstrap::testing::RedisFixture fx;
  auto store = fx.Connect("coord");
  auto coord = MakeStoreCoordinator(*store);
  REQUIRE(coord.ok());
  std::thread waiter([&] {
    auto r = (*coord)->WaitAllDurable(5, 2, 3.0);  // rank 1 never writes: times out after 3 s
    CHECK_FALSE(r.ok());
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const double t0 = NowSeconds();
  CHECK((*coord)->MarkFailed(7, 0, Aborted("skipped")).ok());
  CHECK(NowSeconds() - t0 < 1.0);
  waiter.join();
}

TEST_CASE("a store restart just before rank 0 begins a checkpoint abandons it instead of waiting for lost marks") {
  // Rank 1 begins step 12 and marks it durable on the server; the server is killed and restarted (the driver's
  // store_lost recovery: keys are lost); only then does rank 0 begin step 12. Both of rank 0's looks at the server
  // (its begin, its wait) see the new one, yet rank 1's mark is gone: rank 0 waited out the coordination timeout
  // while rank 1 waited in the next collective (the Gloo timeout, then a job restart).
  bootstrap::testing::RedisFixture fx;
  auto store0 = fx.Connect("coord");
  auto store1 = fx.Connect("coord");
  auto rank0 = MakeStoreCoordinator(*store0);
  auto rank1 = MakeStoreCoordinator(*store1);
  REQUIRE(rank0.ok());
  REQUIRE(rank1.ok());
  checkpoint::FileInfo info;
  info.name = "rank-00000.bin";
  // Step 10: committed on the first server.
  REQUIRE((*rank0)->BeginStep(10).ok());
  REQUIRE((*rank1)->BeginStep(10).ok());
  info.rank = 1;
  REQUIRE((*rank1)->MarkDurable(10, 1, info).ok());
  info.rank = 0;
  REQUIRE((*rank0)->MarkDurable(10, 0, info).ok());
  auto committed = (*rank0)->WaitAllDurable(10, 2, 5.0);
  REQUIRE_MESSAGE(committed.ok(), committed.status().ToString());
  // Step 12: rank 1's mark lands on the server that dies.
  REQUIRE((*rank1)->BeginStep(12).ok());
  info.rank = 1;
  REQUIRE((*rank1)->MarkDurable(12, 1, info).ok());
  REQUIRE(kill(fx.redis->pid(), SIGKILL) == 0);
  for (int i = 0; i < 200 && !fx.redis->PollExit(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  REQUIRE_FALSE(fx.redis->running());
  REQUIRE(fx.redis->Restart().ok());
  REQUIRE((*rank0)->BeginStep(12).ok());
  info.rank = 0;
  REQUIRE((*rank0)->MarkDurable(12, 0, info).ok());
  const double t0 = NowSeconds();
  auto lost = (*rank0)->WaitAllDurable(12, 2, 4.0);
  CHECK(NowSeconds() - t0 < 2.0);
  REQUIRE_FALSE(lost.ok());
  CHECK_MESSAGE(lost.status().code() == Code::kUnavailable, lost.status().ToString());
  CHECK_MESSAGE(lost.status().message().find("restarted") != std::string::npos, lost.status().ToString());
  // The next checkpoint is coordinated on the new server.
  for (auto* c : {&*rank0, &*rank1}) REQUIRE((*c)->BeginStep(14).ok());
  REQUIRE((*rank1)->MarkDurable(14, 1, info).ok());
  info.rank = 0;
  REQUIRE((*rank0)->MarkDurable(14, 0, info).ok());
  committed = (*rank0)->WaitAllDurable(14, 2, 5.0);
  CHECK_MESSAGE(committed.ok(), committed.status().ToString());
}

TEST_CASE("waiting for one rank's long work: no timeout while it makes progress, a clear one when it is silent") {
  bootstrap::testing::RedisFixture fx;
  auto leader_store = fx.Connect("leader");
  auto follower_store = fx.Connect("leader");
  // The leader works 2.5 s, far longer than the 0.5 s silence bound: its beats keep the follower waiting.
  Status follower_result = Internal("not run");
  std::thread follower([&] {
    follower_result = WaitForLeader(follower_store.get(), "work/a", /*leader=*/false, 0.5, [] { return Status::Ok(); });
  });
  Status led = WaitForLeader(leader_store.get(), "work/a", /*leader=*/true, 0.5, [] {
    std::this_thread::sleep_for(std::chrono::milliseconds(2500));
    return Status::Ok();
  });
  follower.join();
  CHECK(led.ok());
  CHECK_MESSAGE(follower_result.ok(), follower_result.ToString());
  // The leader's failure reaches the follower.
  std::thread follower2([&] {
    follower_result = WaitForLeader(follower_store.get(), "work/b", false, 0.5, [] { return Status::Ok(); });
  });
  CHECK_FALSE(WaitForLeader(leader_store.get(), "work/b", true, 0.5, [] { return IoError("disk on fire"); }).ok());
  follower2.join();
  CHECK(follower_result.code() == Code::kAborted);
  CHECK(follower_result.message().find("disk on fire") != std::string::npos);
  // No leader at all: the follower gives up after the silence bound, saying so.
  const double t0 = NowSeconds();
  Status alone = WaitForLeader(follower_store.get(), "work/c", false, 1.0, [] { return Status::Ok(); });
  CHECK(alone.code() == Code::kTimeout);
  CHECK(alone.message().find("no progress") != std::string::npos);
  CHECK(NowSeconds() - t0 < 5.0);
}

TEST_CASE("a run directory is locked for the job's lifetime, naming its holder") {
  const std::string dir = TempDir("lock");
  {
    auto first = DirLock::Acquire(dir, "log.run_dir", "pid 1 on host a, job \"x\"");
    REQUIRE(first.ok());
    auto second = DirLock::Acquire(dir, "log.run_dir", "pid 2 on host b, job \"y\"");
    REQUIRE_FALSE(second.ok());
    CHECK(second.status().code() == Code::kFailedPrecondition);
    CHECK(second.status().message().find("pid 1 on host a") != std::string::npos);
    CHECK(second.status().message().find("in use by another megascale job") != std::string::npos);
  }
  auto again = DirLock::Acquire(dir, "log.run_dir", "pid 3");  // released with the first
  CHECK(again.ok());
  std::filesystem::remove_all(dir);
}

}  // namespace ms::runner

namespace ms::runner {

TEST_CASE("the stop grace scales with the checkpoint, and the job id survives any job name") {
  config::JobSpec spec;
  spec.model.layers = 4;
  spec.model.hidden = 2048;
  spec.model.ffn_hidden = 8192;
  spec.model.vocab = 256;
  spec.model.seq_len = 16;
  // 4 layers * 12 * 2048^2 + embeddings: ~202 M parameters, 2.4 GB with both Adam moments.
  CHECK(ApproxParams(spec.model) == doctest::Approx(201.9e6).epsilon(0.01));
  CHECK(StopGraceSeconds(spec) == doctest::Approx(60 + 24.2).epsilon(0.01));
  spec.model.hidden = 32;
  spec.model.ffn_hidden = 128;
  CHECK(StopGraceSeconds(spec) == doctest::Approx(60).epsilon(0.01));
  spec.runtime.stop_grace_s = 7;
  CHECK(StopGraceSeconds(spec) == 7);
  const std::string id = JobId("tiny run 2 \"quoted\" $(rm -rf /)");
  CHECK(id.rfind("tiny-run-2--quoted----rm--rf---", 0) == 0);
  CHECK(id.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") == std::string::npos);
  CHECK(JobId("x") != JobId("x"));
  CHECK(JobId("").rfind("job-", 0) == 0);
}

}  // namespace ms::runner

namespace ms::runner {

TEST_CASE("a layout that does not fit the Slurm allocation is refused before launch, naming both sides") {
  config::JobSpec spec;
  spec.parallel.tp = 2;
  spec.parallel.pp = 2;
  spec.parallel.dp = 2;
  cluster::SlurmAllocation a;
  a.job_id = "55";
  a.nodes = {"node0", "node1"};
  a.tasks_per_node = {4, 4};
  a.tasks = 8;
  auto fit = FitSlurmAllocation(spec, a);
  REQUIRE(fit.ok());
  CHECK(fit->nodes == 2);
  CHECK(fit->tasks_per_node == 4);
  // Fewer tasks than ranks: both sides and the fixes named.
  a.nodes = {"node0", "node1", "node2"};
  a.tasks_per_node = {2, 2, 2};
  a.tasks = 6;
  auto small = FitSlurmAllocation(spec, a);
  REQUIRE_FALSE(small.ok());
  CHECK(small.status().message().find("2*2*2 = 8 ranks") != std::string::npos);
  CHECK(small.status().message().find("6 tasks on 3 nodes") != std::string::npos);
  CHECK(small.status().message().find("--nodes=4 --ntasks-per-node=2") != std::string::npos);
  // A tensor-parallel group across two nodes.
  spec.parallel.tp = 4;
  spec.parallel.dp = 1;
  a.nodes = {"node0", "node1", "node2", "node3"};
  a.tasks_per_node = {2, 2, 2, 2};
  a.tasks = 8;
  auto straddle = FitSlurmAllocation(spec, a);
  REQUIRE_FALSE(straddle.ok());
  CHECK(straddle.status().message().find("straddle two nodes") != std::string::npos);
  CHECK(straddle.status().message().find("--ntasks-per-node=4") != std::string::npos);
  // Uneven tasks per node.
  spec.parallel.tp = 2;
  spec.parallel.dp = 2;
  a.nodes = {"node0", "node1"};
  a.tasks_per_node = {6, 2};
  auto uneven = FitSlurmAllocation(spec, a);
  REQUIRE_FALSE(uneven.ok());
  CHECK(uneven.status().message().find("(6,2)") != std::string::npos);
  // Spare whole nodes are allowed (the fault tolerance runs without a bad node on one of them).
  spec.parallel.dp = 2;
  a.nodes = {"node0", "node1", "node2"};
  a.tasks_per_node = {4, 4, 4};
  a.tasks = 12;
  auto spare = FitSlurmAllocation(spec, a);
  REQUIRE(spare.ok());
  CHECK(spare->nodes == 2);
  a.nodes = {"node0", "node1"};
  a.tasks_per_node = {4, 4};
  a.tasks = 8;
  // dp offered as the fix when tp * pp divides the tasks.
  spec.parallel.dp = 3;
  a.tasks_per_node = {4, 4};
  auto dp = FitSlurmAllocation(spec, a);
  REQUIRE_FALSE(dp.ok());
  CHECK(dp.status().message().find("parallel.dp: 2") != std::string::npos);
}

TEST_CASE("the store listens where the other nodes can reach it, or where the spec says") {
  config::JobSpec spec;
  CHECK(*ChooseStoreAddress(spec, nullptr) == "127.0.0.1");
  cluster::SlurmAllocation only_me;
  only_me.nodes = {HostName()};
  CHECK(*ChooseStoreAddress(spec, &only_me) == "127.0.0.1");
  cluster::SlurmAllocation local_peer;
  local_peer.nodes = {"localhost"};
  CHECK(*ChooseStoreAddress(spec, &local_peer) == "127.0.0.1");
  spec.runtime.interface = "lo";
  CHECK(*ChooseStoreAddress(spec, nullptr) == "127.0.0.1");
  spec.runtime.address = "10.9.8.7";
  CHECK(*ChooseStoreAddress(spec, nullptr) == "10.9.8.7");
  spec.runtime.address.clear();
  spec.runtime.interface = "nope0";
  CHECK_FALSE(ChooseStoreAddress(spec, nullptr).ok());
}

}  // namespace ms::runner

namespace ms::runner {

TEST_CASE("a heartbeat says what the rank does, and the driver reads it back") {
  ProgressBoard b;
  b.set_pp_rank(1);
  const int tp = b.RegisterGroup("tp[0]");
  b.RegisterGroup("dp[3]");
  b.SetStep(5);
  b.SetPhase(Phase::kBackward);
  for (int64_t s = 1; s <= 70; ++s) b.RecordStep(s, 0.02, 0.015, 0.005);  // more than the ring holds
  b.EnterWait(tp, "all-reduce");
  const std::string text = "n=3\nt=1795486100.123456\nrank=1\nhost=node2\npid=42\n" + b.Snapshot();
  auto beat = ParseHeartbeat(text);
  REQUIRE_MESSAGE(beat.ok(), beat.status().ToString(), "\n", text);
  CHECK(beat->n == 3);
  CHECK(beat->rank == 1);
  CHECK(beat->host == "node2");
  CHECK(beat->pp_rank == 1);
  CHECK(beat->groups == std::vector<std::string>{"tp[0]", "dp[3]"});
  CHECK(beat->step == 5);
  CHECK(beat->phase == "backward");
  CHECK(beat->wait_op == "all-reduce");
  CHECK(beat->wait_group == "tp[0]");
  REQUIRE(beat->steps.size() == 64);
  CHECK(beat->steps.front().step == 7);
  CHECK(beat->steps.back().step == 70);
  CHECK(beat->steps.back().compute_s == doctest::Approx(0.015));
  b.LeaveWait();
  auto idle = ParseHeartbeat("n=4\nt=1\nrank=1\nhost=h\npid=1\n" + b.Snapshot());
  REQUIRE(idle.ok());
  CHECK(idle->wait_group.empty());
  CHECK_FALSE(idle->exited);
  // The last beat (final=1) says "done" whatever the board showed, wherever the key stands in the text.
  b.EnterWait(tp, "all-reduce");
  for (const std::string& last :
       {"n=5\nt=1\nrank=1\nhost=h\npid=1\n" + b.Snapshot() + "final=1\n", "final=1\nn=5\nrank=1\n" + b.Snapshot()}) {
    auto done = ParseHeartbeat(last);
    REQUIRE(done.ok());
    CHECK(done->phase == "done");
    CHECK(done->exited);
    CHECK(done->wait_group.empty());
  }
  CHECK_FALSE(ParseHeartbeat("n=x\nrank=1\n").ok());
}

}  // namespace ms::runner

namespace ms::runner {

TEST_CASE("a rank that finished is not lost while the others train on; one that went silent is") {
  bootstrap::testing::RedisFixture fx;
  config::FaultSpec spec;
  spec.heartbeat_s = 0.05;
  spec.heartbeat_timeout_s = 0.4;
  const std::string dir = TempDir("monitor");
  EventLog events(dir + "/events.jsonl");
  Monitor monitor(fx.Connect("mon"), 2, spec, dir, 0, &events);
  ProgressBoard b0, b1;
  for (ProgressBoard* b : {&b0, &b1}) {
    b->RegisterGroup("dp[0]");
    b->SetStep(3);
    b->SetPhase(Phase::kForward);
  }
  // Rank 0 beats through Heartbeat (its destructor publishes the final beat); rank 1's beats are written here,
  // so that it can stop the way a killed process stops: without a final beat.
  auto store1 = fx.Connect("mon");
  int64_t n1 = 0;
  auto beat1 = [&] {
    REQUIRE(
        store1->Set(HeartbeatKey(1), fmt::format("n={}\nt=1\nrank=1\nhost=h1\npid=1\n", ++n1) + b1.Snapshot()).ok());
  };
  beat1();
  {
    auto h0 = Heartbeat::Start(fx.Connect("mon"), 0, "h0", spec.heartbeat_s, &b0);
    for (double until = NowSeconds() + 5; NowSeconds() < until && monitor.Where(0) == "no heartbeat yet";) {
      CHECK_FALSE(monitor.Poll());
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    REQUIRE(monitor.Where(0) == "step 3, forward");
    b0.EnterWait(0, "all-reduce");  // it ends in the middle of a wait: its last beat must not show it there
  }
  // Rank 0 is silent for three times the timeout while rank 1 beats on: no fault.
  for (double until = NowSeconds() + 3 * spec.heartbeat_timeout_s; NowSeconds() < until;) {
    beat1();
    auto f = monitor.Poll();
    CHECK_MESSAGE(!f, (f ? f->kind + ": " + f->detail : std::string()));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  CHECK(monitor.Where(0) == "step 3, done");
  CHECK(monitor.Where(1) == "step 3, forward");
  // Rank 1 stops beating without a final beat (SIGKILL, a dead host): lost, and rank 0 is not.
  std::optional<Fault> lost;
  for (double until = NowSeconds() + 5; NowSeconds() < until && !lost;) {
    lost = monitor.Poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(lost);
  CHECK(lost->kind == "lost_heartbeat");
  CHECK(lost->rank == 1);
  CHECK(lost->host == "h1");
  CHECK(lost->detect_latency_s >= spec.heartbeat_timeout_s);
  std::filesystem::remove_all(dir);
}

TEST_CASE("srun's reports of its tasks' ends are read as rank exits") {
  auto killed = ParseSrunTaskLine("srun: error: node1: task 3: Killed", 8);
  REQUIRE(killed.size() == 1);
  CHECK(killed[0].rank == 3);
  CHECK(killed[0].host == "node1");
  CHECK(WIFSIGNALED(killed[0].status));
  CHECK(WTERMSIG(killed[0].status) == SIGKILL);
  auto exited = ParseSrunTaskLine("srun: error: node0: tasks 0-2,5: Exited with exit code 75", 8);
  REQUIRE(exited.size() == 4);
  CHECK(exited[3].rank == 5);
  CHECK(WIFEXITED(exited[0].status));
  CHECK(WEXITSTATUS(exited[0].status) == 75);
  CHECK(ParseSrunTaskLine("srun: Force Terminated StepId=2.0", 8).empty());
  CHECK(ParseSrunTaskLine("srun: error: node0: tasks 7-9: Killed", 8).size() == 1);  // out of range dropped
}

}  // namespace ms::runner

namespace {
ms::runner::RankCheck Check(int rank, const std::string& host, double gemm) {
  ms::runner::RankCheck r;
  r.rank = rank;
  r.host = host;
  r.gemm_flops = gemm;
  r.provider = "tcp;ofi_rxm";
  return r;
}
}  // namespace

TEST_CASE("self-check results survive the store's text form") {
  auto r = Check(3, "node-1", 1.25e10);
  r.memory_bytes_per_s = 9e9;
  r.links.push_back({5, "node-2", 4.5e-5, 3.2e8});
  r.allreduce_s = 0.0125;
  r.allreduce_bus_bytes_per_s = 1.5e9;
  r.errors.push_back("link to rank 7: timed out\nafter 60 s");
  auto back = ms::runner::ParseRankCheck(ms::runner::FormatRankCheck(r));
  REQUIRE(back.ok());
  CHECK(back->rank == 3);
  CHECK(back->host == "node-1");
  CHECK(back->provider == "tcp;ofi_rxm");
  CHECK(back->gemm_flops == doctest::Approx(1.25e10));
  CHECK(back->memory_bytes_per_s == doctest::Approx(9e9));
  REQUIRE(back->links.size() == 1);
  CHECK(back->links[0].peer == 5);
  CHECK(back->links[0].peer_host == "node-2");
  CHECK(back->links[0].bytes_per_s == doctest::Approx(3.2e8));
  CHECK(back->allreduce_bus_bytes_per_s == doctest::Approx(1.5e9));
  REQUIRE(back->errors.size() == 1);
  CHECK(back->errors[0] == "link to rank 7: timed out after 60 s");
  CHECK(!ms::runner::ParseRankCheck("host=x\n").ok());
  CHECK(!ms::runner::ParseRankCheck("rank=1\nlink=garbage\n").ok());
}

TEST_CASE("self-check: a slow GEMM, a slow endpoint and a failed check are flagged, and nothing else") {
  using ms::runner::AnalyzeSelfCheck;
  std::vector<ms::runner::RankCheck> ranks = {Check(0, "a", 10e9), Check(1, "a", 11e9), Check(2, "b", 9.5e9),
                                              Check(3, "b", 10.5e9)};
  auto healthy = AnalyzeSelfCheck(ranks, 0.5);
  CHECK(healthy.passed());
  CHECK(healthy.bad_hosts.empty());

  ranks[2].gemm_flops = 3e9;  // 3.3x below the median
  auto slow = AnalyzeSelfCheck(ranks, 0.5);
  REQUIRE(slow.failures.size() == 1);
  CHECK(slow.failures[0].find("rank 2 on b: GEMM 3.0 GFLOP/s") == 0);
  CHECK(slow.bad_hosts == std::set<std::string>{"b"});
  CHECK(AnalyzeSelfCheck(ranks, 3.0).passed());  // within a tolerance of 3 (below median / 4 only)
  ranks[2].gemm_flops = 9.5e9;

  // Links among 4 endpoints: every link of rank 1 is 4x slower; only rank 1 is named.
  auto link = [](int peer, const char* host, double lat, double bw) {
    return ms::runner::RankCheck::Link{peer, host, lat, bw};
  };
  ranks[0].links = {link(1, "a", 200e-6, 100e6), link(2, "b", 50e-6, 400e6), link(3, "b", 50e-6, 400e6)};
  ranks[1].links = {link(2, "b", 200e-6, 100e6), link(3, "b", 200e-6, 100e6)};
  ranks[2].links = {link(3, "b", 52e-6, 390e6)};
  auto links = AnalyzeSelfCheck(ranks, 0.5);
  REQUIRE(links.failures.size() == 2);  // its latency and its bandwidth
  for (const auto& f : links.failures) CHECK(f.find("rank 1 on a: link") == 0);
  CHECK(links.bad_hosts == std::set<std::string>{"a"});

  // Two endpoints: links are shown, not judged.
  std::vector<ms::runner::RankCheck> two = {Check(0, "a", 10e9), Check(1, "b", 10e9)};
  two[0].links = {link(1, "b", 900e-6, 1e6)};
  auto pair = AnalyzeSelfCheck(two, 0.5);
  CHECK(pair.passed());
  CHECK(pair.table.find("links are not judged") != std::string::npos);

  // A check that failed on a rank fails the whole self-check.
  two[1].errors.push_back("libfabric provider verbs: not found");
  auto failed = AnalyzeSelfCheck(two, 0.5);
  REQUIRE(failed.failures.size() == 1);
  CHECK(failed.failures[0] == "rank 1 on b: libfabric provider verbs: not found");
}

namespace ms::runner {

TEST_CASE("the MFU peak of a GPU model comes from its datasheet (dense bf16)") {
  CHECK(DatasheetPeak("cuda:0 (NVIDIA H100 80GB HBM3)") == 989e12);
  CHECK(DatasheetPeak("cuda:0 (NVIDIA H100 PCIe)") == 756e12);
  CHECK(DatasheetPeak("cuda:0 (NVIDIA H100 NVL)") == 835e12);
  CHECK(DatasheetPeak("cuda:1 (NVIDIA H200)") == 989e12);
  CHECK(DatasheetPeak("cuda:0 (NVIDIA A100-SXM4-80GB)") == 312e12);
  CHECK(DatasheetPeak("cuda:0 (NVIDIA B200)") == 2250e12);
  CHECK(DatasheetPeak("cuda:0 (NVIDIA GeForce RTX 4090)") == 0);  // unknown: measured instead
  CHECK(DatasheetPeak("cpu") == 0);
}

}  // namespace ms::runner
