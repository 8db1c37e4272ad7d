// The driver: RunJob checks, locks and prepares the run, then trains in-process (one rank) or
// launches an attempt of worker processes and supervises it (see runner.h for the contract).
#include <limits.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "bootstrap/bootstrap.h"
#include "runner/attempt.h"
#include "runner/driver.h"
#include "runner/run_dir.h"
#include "runner/runner.h"
#include "runner/signals.h"

namespace ms::runner {

int ExitCode(JobEnd end) {
  switch (end) {
    case JobEnd::kCompleted:
      return kExitCompleted;
    case JobEnd::kSavedOnSignal:
      return kExitSaved;
    case JobEnd::kInterrupted:
      return kExitInterrupted;
  }
  return kExitFailed;
}

namespace {

std::string RandomHex(int bytes) {
  Rng rng(static_cast<uint64_t>(NowSeconds() * 1e9) ^ (static_cast<uint64_t>(getpid()) << 32));
  std::string s;
  for (int i = 0; i < bytes; ++i) s += fmt::format("{:02x}", static_cast<unsigned>(rng.NextU64() & 0xff));
  return s;
}

// Exit code of a rank, or -1 when it was killed by a signal.
int RankCode(int status) {
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}
bool RankFailed(int status) {
  const int code = RankCode(status);
  return code != kExitCompleted && code != kExitSaved && code != kExitInterrupted;
}

struct SuperviseOptions {
  std::string run_dir;
  double grace_s = 60;
  bootstrap::EmbeddedRedis* redis = nullptr;  // restarted if it dies; null: external
};

// Watches an attempt until every rank has exited. Policy:
//   - SIGTERM/SIGINT to the driver: forwarded; the ranks get grace_s to save (SIGTERM) and exit.
//     A second stop signal during that grace kills them at once (the pending save is given up;
//     earlier checkpoints are intact). SIGUSR1 is forwarded (a checkpoint on demand).
//   - The first rank that fails (non-zero exit other than kExitSaved / kExitInterrupted, or a
//     signal) stops the others: SIGTERM, then SIGKILL after 10 s. The cause named is a rank that
//     died by a signal if there is one (its peers then fail in their collectives), else the first.
//   - The embedded Redis dying is noticed (its PID only) and it is restarted on its port.
Result<JobEnd> Supervise(Attempt& attempt, int world, const SuperviseOptions& o) {
  enum class Phase { kRunning, kStopping, kFailing } phase = Phase::kRunning;
  double deadline = 0;
  int stop_signal = 0;
  std::optional<RankExit> cause;
  std::vector<RankExit> exits;
  bool killed_on_second = false, grace_expired = false;
  while (!attempt.AllExited()) {
    const SignalCounts sig = TakeSignals();
    if (phase == Phase::kRunning && (sig.terminate || sig.interrupt)) {
      stop_signal = sig.terminate ? SIGTERM : SIGINT;  // both at once: saving is the safer reading
      phase = Phase::kStopping;
      deadline = NowSeconds() + o.grace_s;
      LogWarn("driver got {}: {} all {} ranks after their current step (grace {:.0f} s; send it again to stop at once)",
              strsignal(stop_signal), stop_signal == SIGTERM ? "checkpointing and stopping" : "stopping", world,
              o.grace_s);
      attempt.Signal(stop_signal);
    } else if (phase != Phase::kRunning && (sig.terminate || sig.interrupt)) {
      LogError("driver got a second stop signal ({}): killing every rank now; {}",
               strsignal(sig.terminate ? SIGTERM : SIGINT),
               stop_signal == SIGTERM ? "the checkpoint of this stop is given up (earlier checkpoints are intact)"
                                      : "nothing is saved");
      killed_on_second = true;
      attempt.Kill();
    } else if (sig.save) {
      if (phase == Phase::kRunning) {
        LogInfo("SIGUSR1: asking all {} ranks for a checkpoint", world);
        attempt.Signal(SIGUSR1);
      } else {
        LogInfo("SIGUSR1 ignored: the ranks are already stopping");
      }
    }
    if (o.redis) {
      if (auto status = o.redis->PollExit()) {
        LogError("the embedded redis-server (port {}) died ({}); restarting it on the same port. Its log: {}",
                 o.redis->port(), DescribeExit(*status), o.redis->LogTail());
        Status restarted = o.redis->Restart();
        if (!restarted.ok()) {
          LogError(
              "restarting the embedded redis-server failed: {}; checkpoints cannot be coordinated until the "
              "job ends",
              restarted.message());
        }
      }
    }
    for (RankExit& e : attempt.Poll()) {
      exits.push_back(e);
      if (phase != Phase::kFailing && RankFailed(e.status) && !e.collateral && !killed_on_second) {
        // Its peers fail within moments (their collectives break): reap them first, so that the
        // rank that died by a signal -- the cause -- is the one named.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        for (RankExit& more : attempt.Poll()) exits.push_back(more);
        cause = e;
        for (const RankExit& x : exits) {
          if (RankFailed(x.status) && !x.collateral && WIFSIGNALED(x.status) && !WIFSIGNALED(cause->status)) cause = x;
        }
        for (const RankExit& x : exits) {
          if (RankFailed(x.status) && !x.collateral) {
            LogError("rank {} on {} failed: {}", x.rank, x.host, DescribeExit(x.status));
          }
        }
        if (!attempt.Running().empty()) LogError("stopping the other {} ranks", attempt.Running().size());
        attempt.Signal(SIGTERM);
        phase = Phase::kFailing;
        deadline = NowSeconds() + 10.0;
      }
    }
    if (phase != Phase::kRunning && !attempt.AllExited() && NowSeconds() > deadline) {
      auto running = attempt.Running();
      if (phase == Phase::kStopping) {
        grace_expired = true;
        LogError("rank(s) {} did not exit within the grace of {:.0f} s (runtime.stop_grace_s); killing them",
                 fmt::join(running, ", "), o.grace_s);
      }
      attempt.Kill();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (RankExit& e : attempt.Poll()) exits.push_back(e);
  auto failure = [&](const RankExit& e) {
    const std::string log = fmt::format("{}/logs/rank-{}.log", o.run_dir, e.rank);
    const std::string launcher = attempt.LauncherError();
    if (e.host.empty() && !launcher.empty()) {
      return Aborted("the ranks' launch failed ({}): {}", DescribeExit(e.status), launcher);
    }
    return Aborted(
        "rank {}{} failed ({}); {}", e.rank, e.host.empty() ? "" : " on " + e.host, DescribeExit(e.status),
        std::filesystem::exists(log) ? "its log: " + log : std::string("it wrote no log (it failed during start-up)"));
  };
  if (cause) return failure(*cause);
  if (killed_on_second) {
    return Aborted("job stopped by a second {} before the ranks had finished stopping", strsignal(stop_signal));
  }
  if (grace_expired)
    return Aborted("job stopped by {}: the ranks did not exit within the grace", strsignal(stop_signal));
  for (const RankExit& e : exits) {
    if (RankFailed(e.status) && !e.collateral) return failure(e);
  }
  int saved = 0, interrupted = 0;
  for (const RankExit& e : exits) {
    if (RankFailed(e.status)) {
      // Only collateral ends: the attempt was stopped from outside (a cancelled job step) or by us.
      const std::string launcher = attempt.LauncherError();
      if (!launcher.empty()) return Aborted("{}: its ranks were killed ({})", launcher, DescribeExit(e.status));
      return failure(e);
    }
    saved += RankCode(e.status) == kExitSaved;
    interrupted += RankCode(e.status) == kExitInterrupted;
  }
  if (interrupted > 0) return JobEnd::kInterrupted;
  // Ranks that completed after a SIGTERM got it after their last step: a completed run.
  return saved > 0 ? JobEnd::kSavedOnSignal : JobEnd::kCompleted;
}

Result<JobEnd> RunRanks(const config::JobSpec& spec, const TrainOptions& options,
                        const std::optional<cluster::SlurmAllocation>& alloc, double driver_start) {
  const int world = static_cast<int>(config::WorldSize(spec.parallel));
  const std::string& run_dir = spec.log.run_dir;
  const std::string spec_path = run_dir + "/job.yaml";
  MS_RETURN_IF_ERROR(WriteFileAtomic(spec_path, config::ToYaml(spec)));

  std::optional<bootstrap::EmbeddedRedis> redis;
  std::string url = spec.runtime.redis, password;
  if (!spec.runtime.redis_password_file.empty()) {
    MS_ASSIGN_OR_RETURN(password, ReadFile(spec.runtime.redis_password_file));
    while (!password.empty() && (password.back() == '\n' || password.back() == '\r')) password.pop_back();
  }
  if (url.empty()) {
    bootstrap::EmbeddedRedisOptions ro;
    ro.max_clients = std::max(1000, 4 * world);
    // Its pid file and log live (and, after a crash, stay) in the run directory; redis-server
    // changes into its directory, so the path must be absolute.
    char abs_dir[PATH_MAX];
    if (realpath(run_dir.c_str(), abs_dir) == nullptr) return ErrnoError(fmt::format("resolving {}", run_dir), errno);
    ro.temp_parent = abs_dir;
    MS_ASSIGN_OR_RETURN(ro.bind_address, ChooseStoreAddress(spec, alloc ? &*alloc : nullptr));
    MS_ASSIGN_OR_RETURN(auto r, bootstrap::EmbeddedRedis::Start(ro));
    redis.emplace(std::move(r));
    url = redis->url();
    password = redis->password();
    LogInfo("started redis-server (pid {}) on {}:{} for the rank bootstrap", redis->pid(), redis->address(),
            redis->port());
  }
  const double store_ready = WallSeconds();
  const std::string job_id = JobId(spec.name);
  const int threads = spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, NumCores() / world);
  MS_ASSIGN_OR_RETURN(const std::string exe, SelfExecutable());

  LaunchPlan plan;
  plan.exe = exe;
  plan.world = world;
  plan.args = [&](int r) {
    std::vector<std::string> args = {"worker", spec_path};
    if (!options.progress || r != 0) args.push_back("--no-progress");
    if (options.resume_step >= 0) {
      args.push_back("--resume-step");
      args.push_back(std::to_string(options.resume_step));
    }
    if (!options.dump_params_dir.empty()) {
      args.push_back("--dump-params");
      args.push_back(options.dump_params_dir);
    }
    return args;
  };
  // The password travels in the environment only (never on a command line, in a file or a log).
  plan.env = {fmt::format("MEGASCALE_WORLD={}", world), fmt::format("MEGASCALE_STORE_URL={}", url),
              fmt::format("MEGASCALE_JOB_ID={}", job_id)};
  if (!password.empty()) plan.env.push_back("MEGASCALE_REDIS_PASSWORD=" + password);
  // Start-up milestones, for the "startup" row of metrics.jsonl.
  plan.env.push_back(fmt::format("MEGASCALE_STARTUP=driver_start={:.6f},store_ready={:.6f},launch={:.6f}", driver_start,
                                 store_ready, WallSeconds()));
  std::unique_ptr<Attempt> attempt;
  if (alloc) {
    MS_ASSIGN_OR_RETURN(SlurmFit fit, FitSlurmAllocation(spec, *alloc));
    SlurmStep step;
    step.job_id = alloc->job_id;
    step.nodes = fit.nodes;
    step.tasks_per_node = fit.tasks_per_node;
    step.name = "megascale-" + job_id;
    LogInfo("launching {} ranks as a Slurm job step of job {}: {} node{} x {} tasks, job id {}", world, alloc->job_id,
            fit.nodes, fit.nodes == 1 ? "" : "s", fit.tasks_per_node, job_id);
    MS_ASSIGN_OR_RETURN(attempt, LaunchSlurmStep(plan, step));
  } else {
    plan.env.push_back(fmt::format("MEGASCALE_LOCAL_WORLD={}", world));
    plan.env.push_back(fmt::format("OMP_NUM_THREADS={}", threads));
    plan.rank_env = [](int r) {
      return std::vector<std::string>{fmt::format("MEGASCALE_RANK={}", r), fmt::format("MEGASCALE_LOCAL_RANK={}", r)};
    };
    LogInfo("launching {} local ranks ({} threads each), job id {}", world, threads, job_id);
    MS_ASSIGN_OR_RETURN(attempt, LaunchLocal(plan));
  }
  SuperviseOptions so;
  so.run_dir = run_dir;
  so.grace_s = StopGraceSeconds(spec);
  so.redis = redis ? &*redis : nullptr;
  Result<JobEnd> end = Supervise(*attempt, world, so);
  attempt.reset();
  if (redis) {
    Status stopped = redis->Stop();  // after the ranks: they needed it for their last checkpoint
    if (!stopped.ok()) LogWarn("stopping the embedded redis-server: {}", stopped.message());
  }
  return end;
}

}  // namespace

std::string JobId(const std::string& name) {
  std::string id;
  for (char c : name) {
    const bool keep =
        (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-';
    if (id.size() < 40) id += keep ? c : '-';
  }
  if (id.empty()) id = "job";
  return id + "-" + RandomHex(6);
}

double ApproxParams(const config::ModelSpec& m) {
  const double C = m.hidden, F = m.ffn_hidden, V = m.vocab, T = m.seq_len, L = m.layers;
  return V * C * (m.tied_embeddings ? 1 : 2) + T * C + L * (4 * C * C + 2 * C * F + 9 * C + F) + 2 * C;
}

double StopGraceSeconds(const config::JobSpec& spec) {
  if (spec.runtime.stop_grace_s > 0) return spec.runtime.stop_grace_s;
  return 60.0 + ApproxParams(spec.model) * 12.0 / 100e6;
}

Result<JobEnd> RunJob(const config::JobSpec& spec, const TrainOptions& options_in) {
  InstallStopSignals();
  const double driver_start = WallSeconds();
  MS_RETURN_IF_ERROR(PreflightCheck(spec, /*files=*/true));
  const std::string holder =
      fmt::format("pid {} on host {}, job \"{}\", started {}", getpid(), HostName(), spec.name, WallClockIso8601());
  MS_ASSIGN_OR_RETURN(DirLock run_lock, DirLock::Acquire(spec.log.run_dir, "log.run_dir", holder));
  std::optional<DirLock> ckpt_lock;
  std::error_code ec;
  if (!std::filesystem::exists(spec.checkpoint.dir) ||
      !std::filesystem::equivalent(spec.checkpoint.dir, spec.log.run_dir, ec)) {
    MS_ASSIGN_OR_RETURN(DirLock l, DirLock::Acquire(spec.checkpoint.dir, "checkpoint.dir", holder));
    ckpt_lock.emplace(std::move(l));
  }
  TrainOptions options = options_in;
  MS_ASSIGN_OR_RETURN(options.resume_step, ChooseStart(spec, options));
  // A stop signal that came while the driver was preparing: nothing was launched, nothing is lost.
  const SignalCounts early = TakeSignals();
  if (early.terminate || early.interrupt) {
    LogWarn("stopped by {} before any rank was launched", early.terminate ? "SIGTERM" : "SIGINT");
    return early.terminate ? JobEnd::kSavedOnSignal : JobEnd::kInterrupted;
  }
  ReturnSignals(early);  // a SIGUSR1: honoured by the ranks after their first step
  if (config::WorldSize(spec.parallel) == 1) {
    auto rt = SingleRankRuntime();
    rt->startup.emplace_back("driver_start", driver_start);
    MS_ASSIGN_OR_RETURN(TrainSummary summary, Train(spec, options, *rt));
    return summary.end;
  }
  MS_ASSIGN_OR_RETURN(auto alloc, cluster::ReadSlurmAllocation());
  return RunRanks(spec, options, alloc, driver_start);
}

}  // namespace ms::runner
