// The driver: RunJob checks, locks and prepares the run, then trains in-process (one rank) or
// launches an attempt of worker processes and supervises it (see runner.h for the contract).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "bootstrap/bootstrap.h"
#include "checkpoint/checkpoint.h"
#include "runner/attempt.h"
#include "runner/driver.h"
#include "runner/loader.h"
#include "runner/monitor.h"
#include "runner/run_dir.h"
#include "runner/runner.h"
#include "runner/self_check.h"
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
    case JobEnd::kRollback:
      return kExitRollback;
    case JobEnd::kStoppedByPolicy:
      return kExitStopPolicy;
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
// A rank's end that is not one of the agreed ends (done, saved, interrupted, rollback, stopped by policy).
bool RankFailed(int status) {
  const int code = RankCode(status);
  return code != kExitCompleted && code != kExitSaved && code != kExitInterrupted && code != kExitRollback &&
         code != kExitStopPolicy;
}

struct SuperviseOptions {
  std::string run_dir;
  double grace_s = 60;
  int attempt = 0;
  bootstrap::EmbeddedRedis* redis = nullptr;  // restarted if it dies; null: external
  Monitor* monitor = nullptr;                 // heartbeats; null: none
  EventLog* events = nullptr;
  std::function<void()> on_tick;  // called every loop (20 ms)
};

// How an attempt ended: a job end, a fault to recover from, or an error that ends the job.
struct AttemptEnd {
  std::optional<JobEnd> end;
  std::optional<Fault> fault;
  Status error;
};

// The last error line a rank left: its own report in the store (error/<rank>), else nothing.
std::string RankError(Monitor* monitor, int rank) {
  if (!monitor) return "";
  return monitor->Note(fmt::format("error/{}", rank));
}

// Watches an attempt until every rank has exited. Policy:
//   - SIGTERM/SIGINT to the driver: forwarded; the ranks get grace_s to save (SIGTERM) and exit.
//     A second stop signal during that grace kills them at once (the pending save is given up;
//     earlier checkpoints are intact). SIGUSR1 is forwarded (a checkpoint on demand).
//   - The first rank that fails (non-zero exit other than the agreed ones, or a signal) is a crash:
//     the others are stopped (SIGTERM, then SIGKILL after 10 s). The rank blamed is one that died
//     by a signal if there is one (its peers then fail in their collectives), else the first.
//   - A lost heartbeat or a hang (the monitor): every rank is killed at once.
//   - Ranks that agreed on a numeric fault exit kExitRollback (a fault to recover from) or
//     kExitStopPolicy (the job ends).
//   - The embedded Redis dying is noticed (its PID only) and it is restarted on its port.
AttemptEnd Supervise(Attempt& attempt, int world, const SuperviseOptions& o) {
  enum class Phase { kRunning, kStopping, kFailing } phase = Phase::kRunning;
  double deadline = 0, next_poll = 0;
  int stop_signal = 0;
  std::optional<RankExit> cause;
  std::optional<Fault> monitored;
  std::vector<RankExit> exits;
  bool killed_on_second = false, grace_expired = false;
  std::vector<int> outlasted;  // the ranks still running when the stop's grace ran out
  const double started = NowSeconds();
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
        const double t0 = NowSeconds();
        LogError("the embedded redis-server (port {}) died ({}); restarting it on the same port. Its log: {}",
                 o.redis->port(), DescribeExit(*status), o.redis->LogTail());
        Status restarted = o.redis->Restart();
        if (!restarted.ok()) {
          LogError(
              "restarting the embedded redis-server failed: {}; checkpoints cannot be coordinated until the "
              "job ends",
              restarted.message());
        }
        if (o.events) {
          o.events->Write("store_lost", [&](metrics::JsonObject& e) {
            e.Add("attempt", o.attempt).Add("detail", DescribeExit(*status));
            e.Add("action", restarted.ok() ? "restarted the store on its port" : "restart failed");
            e.Add("restart_s", NowSeconds() - t0).Add("recovered", restarted.ok() ? 1 : 0);
          });
        }
      }
    }
    if (o.monitor && phase == Phase::kRunning && NowSeconds() >= next_poll) {
      next_poll = NowSeconds() + 0.5;
      if (auto f = o.monitor->Poll()) {
        LogError("{}: {}; stopping every rank", f->kind, f->detail);
        monitored = std::move(f);
        attempt.Kill();
        phase = Phase::kFailing;
      }
    }
    const std::vector<RankExit> batch = attempt.Poll();
    exits.insert(exits.end(), batch.begin(), batch.end());  // all of them first: the cause may be any
    for (const RankExit& e : batch) {
      if (phase != Phase::kFailing && RankFailed(e.status) && !e.collateral && !killed_on_second) {
        // Its peers fail within moments (their collectives break): reap them first, so that the
        // rank that died by a signal -- the cause -- is the one named.
        for (const double until = NowSeconds() + attempt.ReportDelay(); NowSeconds() < until;) {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          for (RankExit& more : attempt.Poll()) exits.push_back(more);
          bool signaled = false;
          for (const RankExit& x : exits) signaled |= RankFailed(x.status) && !x.collateral && WIFSIGNALED(x.status);
          if (signaled) break;  // the likely cause has reported: no need to wait longer
        }
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
      if (phase == Phase::kStopping && !grace_expired) {  // once: killed ranks may take a tick or two to be reaped
        grace_expired = true;
        outlasted = running;
        LogError("rank(s) {} did not exit within the grace of {:.0f} s (runtime.stop_grace_s); killing them",
                 fmt::join(running, ", "), o.grace_s);
      }
      attempt.Kill();
    }
    if (o.on_tick) o.on_tick();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (RankExit& e : attempt.Poll()) exits.push_back(e);
  AttemptEnd out;
  auto log_of = [&](int rank) {
    const std::string log = fmt::format("{}/logs/rank-{}.log", o.run_dir, rank);
    return std::filesystem::exists(log) ? "its log: " + log
                                        : std::string("it wrote no log (it failed during start-up)");
  };
  if (monitored) {
    out.fault = std::move(monitored);
    return out;
  }
  if (cause) {
    const std::string launcher = attempt.LauncherError();
    Fault f;
    f.kind = "crash";
    f.rank = cause->rank;
    f.host = cause->host;
    if (cause->host.empty() && !launcher.empty()) {
      out.error = Aborted("the ranks' launch failed ({}): {}", DescribeExit(cause->status), launcher);
      return out;
    }
    const std::string said = RankError(o.monitor, cause->rank);
    f.detail = fmt::format("rank {}{} failed ({}){}; {}", cause->rank, cause->host.empty() ? "" : " on " + cause->host,
                           DescribeExit(cause->status), said.empty() ? "" : ": " + said, log_of(cause->rank));
    f.detect_latency_s = 0.02;  // the driver reaps its children every 20 ms
    if (o.monitor) f.detail += fmt::format(" (it was at {})", o.monitor->Where(cause->rank));
    if (stop_signal != 0) {  // the job was being stopped: nothing to restart
      out.error = Aborted("{} while the job stopped on {}", f.detail, strsignal(stop_signal));
      return out;
    }
    out.fault = std::move(f);
    return out;
  }
  if (killed_on_second) {
    out.error = Aborted("job stopped by a second {} before the ranks had finished stopping", strsignal(stop_signal));
    return out;
  }
  if (grace_expired) {
    // Name them, with a log to read: a rank stopped (SIGSTOP, a debugger) or stuck where no timeout reaches it, or
    // one waiting for such a peer (its checkpoint's files).
    std::sort(outlasted.begin(), outlasted.end());
    const std::string which = outlasted.empty()       ? std::string("the ranks")
                              : outlasted.size() == 1 ? fmt::format("rank {}", outlasted[0])
                                                      : fmt::format("ranks {}", fmt::join(outlasted, ", "));
    const std::string log = outlasted.empty()       ? std::string()
                            : outlasted.size() == 1 ? "; " + log_of(outlasted[0])
                                                    : fmt::format("; rank {}'s log: {}/logs/rank-{}.log", outlasted[0],
                                                                  o.run_dir, outlasted[0]);
    out.error = Aborted(
        "job stopped by {}: {} did not exit within the grace of {:.0f} s (runtime.stop_grace_s) and {} "
        "killed{}",
        strsignal(stop_signal), which, o.grace_s, outlasted.size() == 1 ? "was" : "were", log);
    return out;
  }
  int saved = 0, interrupted = 0, rollback = 0, stopped = 0;
  for (const RankExit& e : exits) {
    if (RankFailed(e.status)) {
      // Only collateral ends: the attempt was stopped from outside (a cancelled job step) or by us.
      const std::string launcher = attempt.LauncherError();
      out.error = launcher.empty() ? Aborted("rank {}{} ended ({})", e.rank, e.host.empty() ? "" : " on " + e.host,
                                             DescribeExit(e.status))
                                   : Aborted("{}: its ranks were killed ({})", launcher, DescribeExit(e.status));
      return out;
    }
    saved += RankCode(e.status) == kExitSaved;
    interrupted += RankCode(e.status) == kExitInterrupted;
    rollback += RankCode(e.status) == kExitRollback;
    stopped += RankCode(e.status) == kExitStopPolicy;
  }
  if (rollback > 0 || stopped > 0) {
    const std::string note = o.monitor ? o.monitor->Note("fault/note") : std::string();
    Fault f;
    f.kind = note.find("spike") != std::string::npos ? "loss_spike" : "nan";
    f.detail = note.empty() ? std::string("the ranks stopped on a numeric fault") : note;
    f.host_fault = false;
    if (stopped > 0) {
      out.error = Aborted("stopped: {} (the fault policy is stop)", f.detail);
      return out;
    }
    out.fault = std::move(f);
    return out;
  }
  (void)started;
  if (interrupted > 0) {
    out.end = JobEnd::kInterrupted;
  } else {
    // Ranks that completed after a SIGTERM got it after their last step: a completed run.
    out.end = saved > 0 ? JobEnd::kSavedOnSignal : JobEnd::kCompleted;
  }
  return out;
}

// Seconds of productive training in the run: each step's time counted once (its last run; steps
// computed again after a restart are not productive), from metrics.jsonl.
double ProductiveSeconds(const std::string& run_dir) {
  auto text = ReadFile(run_dir + "/metrics.jsonl");
  if (!text.ok()) return 0;
  std::map<int64_t, double> step_s;
  size_t start = 0;
  while (start < text->size()) {
    size_t end = text->find('\n', start);
    if (end == std::string::npos) end = text->size();
    std::string_view line(text->data() + start, end - start);
    start = end + 1;
    if (line.find("\"phase\": \"train\"") == std::string_view::npos) continue;
    auto field = [&](std::string_view key) -> std::optional<double> {
      const std::string k = fmt::format("\"{}\": ", key);
      const size_t at = line.find(k);
      if (at == std::string_view::npos) return std::nullopt;
      return std::strtod(std::string(line.substr(at + k.size(), 32)).c_str(), nullptr);
    };
    auto step = field("step");
    auto secs = field("step_s");
    if (step && secs) step_s[static_cast<int64_t>(*step)] = *secs;
  }
  double sum = 0;
  for (const auto& [k, v] : step_s) sum += v;
  return sum;
}

// When the newest attempt's first step ended (wall clock), from rank 0's "startup" row; 0 if none.
double LastFirstStepWall(const std::string& run_dir) {
  auto text = ReadFile(run_dir + "/metrics.jsonl");
  if (!text.ok()) return 0;
  const size_t at = text->rfind("\"phase\": \"startup\"");
  if (at == std::string::npos) return 0;
  const size_t line_end = text->find('\n', at);
  const std::string line = text->substr(at, line_end == std::string::npos ? std::string::npos : line_end - at);
  auto field = [&](const char* key) {
    const std::string k = fmt::format("\"{}\": ", key);
    const size_t p = line.find(k);
    return p == std::string::npos ? 0.0 : std::strtod(line.c_str() + p + k.size(), nullptr);
  };
  return field("origin_unix_ms") / 1000 + field("first_step_done_s");
}

// The last step rank 0 logged in metrics.jsonl (0 if none).
int64_t LastTrainStep(const std::string& run_dir) {
  auto text = ReadFile(run_dir + "/metrics.jsonl");
  if (!text.ok()) return 0;
  const size_t at = text->rfind("\"phase\": \"train\", \"step\": ");
  if (at == std::string::npos) return 0;
  return std::strtoll(text->c_str() + at + 26, nullptr, 10);
}

// The step the next attempt resumes from: the newest valid checkpoint, or -1 (step 1).
int64_t RestartStep(const config::JobSpec& spec) {
  auto latest = checkpoint::FindLatestValid(spec.checkpoint.dir, checkpoint::Verify::kFull);
  if (!latest.ok()) {
    LogWarn("no valid checkpoint to restart from ({}): the next attempt starts from step 1", latest.status().message());
    return -1;
  }
  return latest->step();
}

// fault.self_check: the self-check on the attempt's placement. Hosts it flags are excluded when
// the Slurm allocation has spare nodes for them all; otherwise the job stops with its findings.
Status CheckBeforeAttempt(const config::JobSpec& spec, const JobStore& store, const Placement& where,
                          const std::string& job_id, int attempt, EventLog& events,
                          std::vector<std::string>& excluded) {
  SelfCheckOptions sco;
  sco.provider = spec.fault.self_check_provider;
  sco.tolerance = spec.fault.self_check_tolerance;
  const double t0 = NowSeconds();
  MS_ASSIGN_OR_RETURN(SelfCheckReport report, RunSelfCheckAttempt(spec, store, where, job_id + "-check", attempt, sco));
  events.Write("self_check", [&](metrics::JsonObject& e) {
    e.Add("attempt", attempt).Add("passed", report.passed() ? 1 : 0).Add("seconds", NowSeconds() - t0);
    e.Add("failures", fmt::format("{}", fmt::join(report.failures, "; ")));
    e.Add("bad_hosts", fmt::format("{}", fmt::join(report.bad_hosts, ",")));
  });
  if (report.passed()) return Status::Ok();
  const int spare = where.alloc ? static_cast<int>(where.alloc->nodes.size() - excluded.size()) - where.fit.nodes : 0;
  if (where.alloc && !report.bad_hosts.empty() && static_cast<int>(report.bad_hosts.size()) <= spare) {
    excluded.insert(excluded.end(), report.bad_hosts.begin(), report.bad_hosts.end());
    LogWarn(
        "self-check before attempt {} flagged host(s) {}: the attempt runs without them (spare nodes of the "
        "allocation take their place)",
        attempt, fmt::join(report.bad_hosts, ", "));
    return Status::Ok();
  }
  return FailedPrecondition(
      "self-check before attempt {} failed: {}. {}", attempt, fmt::join(report.failures, "; "),
      where.alloc
          ? fmt::format("The allocation has {} spare node(s) for {} flagged host(s)", spare, report.bad_hosts.size())
          : std::string("The local launcher has no other host; fix the cause or set fault.self_check: false"));
}

Result<JobEnd> RunRanks(const config::JobSpec& spec, const TrainOptions& options,
                        const std::optional<cluster::SlurmAllocation>& alloc, double driver_start) {
  const int world = static_cast<int>(config::WorldSize(spec.parallel));
  const std::string& run_dir = spec.log.run_dir;
  const std::string spec_path = run_dir + "/job.yaml";
  MS_RETURN_IF_ERROR(WriteFileAtomic(spec_path, config::ToYaml(spec)));

  MS_ASSIGN_OR_RETURN(JobStore store, StartJobStore(spec, alloc ? &*alloc : nullptr, world));
  std::optional<bootstrap::EmbeddedRedis>& redis = store.redis;
  const std::string &url = store.url, &password = store.password;
  const double store_ready = WallSeconds();
  const std::string job_id = JobId(spec.name);
  const int threads = spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, NumCores() / world);
  MS_ASSIGN_OR_RETURN(const std::string exe, SelfExecutable());
  std::optional<SlurmFit> fit;
  if (alloc) {
    MS_ASSIGN_OR_RETURN(fit, FitSlurmAllocation(spec, *alloc));
  }

  EventLog events(run_dir + "/events.jsonl");
  struct Recovery {  // a fault being recovered from: written as "recovered" once the next attempt trains
    std::string kind;
    double detected_at;
    int64_t steps_reached;
    int64_t resumed_from;
  };
  std::optional<Recovery> recovering;
  std::map<std::string, std::map<std::string, int>> host_faults;  // host -> kind -> count
  std::vector<std::string> excluded;
  int64_t resume_step = options.resume_step;
  int faults = 0;
  std::string recovered;  // the faults recovered from, for the final message
  for (int attempt = 0;; ++attempt) {
    LaunchPlan plan;
    plan.exe = exe;
    plan.world = world;
    plan.args = [&](int r) {
      std::vector<std::string> args = {"worker", spec_path};
      if (!options.progress || r != 0) args.push_back("--no-progress");
      if (resume_step >= 0) {
        args.push_back("--resume-step");
        args.push_back(std::to_string(resume_step));
      }
      if (!options.dump_params_dir.empty()) {
        args.push_back("--dump-params");
        args.push_back(options.dump_params_dir);
      }
      return args;
    };
    // The password travels in the environment only (never on a command line, in a file or a log).
    plan.env = RankEnvironment(world, store, job_id, attempt);
    events.Write("attempt", [&](metrics::JsonObject& e) {
      e.Add("attempt", attempt).Add("resume_step", resume_step).Add("world", world);
    });
    Placement where;
    where.alloc = alloc ? &*alloc : nullptr;
    if (fit) where.fit = *fit;
    where.exclude = excluded;
    where.threads = threads;
    if (spec.fault.self_check) {
      MS_RETURN_IF_ERROR(CheckBeforeAttempt(spec, store, where, job_id, attempt, events, excluded));
      where.exclude = excluded;
    }
    // Start-up milestones, for the "startup" row of metrics.jsonl (after the self-check, if any).
    plan.env.push_back(fmt::format("MEGASCALE_STARTUP=driver_start={:.6f},store_ready={:.6f},launch={:.6f}",
                                   driver_start, store_ready, WallSeconds()));
    MS_ASSIGN_OR_RETURN(std::unique_ptr<Attempt> launched,
                        LaunchAttempt(std::move(plan), where, fmt::format("megascale-{}-{}", job_id, attempt),
                                      fmt::format("attempt {} (job id {})", attempt, job_id)));
    // The driver's own view of the attempt's store namespace: heartbeats and the ranks' notes.
    std::unique_ptr<Monitor> monitor;
    {
      bootstrap::StoreOptions so;
      so.url = url;
      so.password = password;
      so.job_id = job_id;
      so.attempt = attempt;
      auto store = bootstrap::ConnectRedisStore(so);
      if (store.ok()) {
        monitor = std::make_unique<Monitor>(std::move(store).value(), world, spec.fault, run_dir, attempt, &events);
      } else {
        LogWarn("the driver cannot read heartbeats ({}): faults are found from exit statuses only",
                store.status().message());
      }
    }
    SuperviseOptions so;
    so.run_dir = run_dir;
    so.grace_s = StopGraceSeconds(spec);
    so.attempt = attempt;
    so.redis = redis ? &*redis : nullptr;
    so.monitor = monitor.get();
    so.events = &events;
    // The recovery of the previous fault is complete when this attempt finishes a step.
    // (A fast attempt may finish before its first heartbeat: rank 0's "startup" row says when.)
    double next_look = 0;
    auto watch_recovery = [&] {
      if (!recovering) return;
      double first_step = 0;
      if (monitor && monitor->first_step_done()) {
        first_step = WallSeconds();
      } else if (NowSeconds() >= next_look) {
        next_look = NowSeconds() + 1;
        const double t = LastFirstStepWall(run_dir);
        if (t > recovering->detected_at) first_step = t;
      }
      if (first_step > 0) {
        const Recovery r = *recovering;
        recovering.reset();
        events.Write("recovered", [&](metrics::JsonObject& e) {
          e.Add("attempt", attempt).Add("fault", r.kind).Add("restart_s", first_step - r.detected_at);
          e.Add("resumed_from_step", r.resumed_from)
              .Add("steps_recomputed", std::max<int64_t>(0, r.steps_reached - std::max<int64_t>(r.resumed_from, 0)));
        });
        LogInfo("recovered from the {} in {:.1f} s: attempt {} trains again from step {}", r.kind,
                first_step - r.detected_at, attempt, r.resumed_from + 1);
      }
    };
    so.on_tick = watch_recovery;
    AttemptEnd result = Supervise(*launched, world, so);
    launched.reset();
    // The shared data loaders' segments of this attempt on this host (a killed rank leaves its own behind;
    // other hosts' are removed by their next attempt).
    if (const int removed = RemoveLoaderSegments(run_dir); removed > 0) {
      LogDebug("removed {} data loader segment(s) left in /dev/shm by attempt {}", removed, attempt);
    }
    if (monitor && result.end) monitor->Finish();
    next_look = 0;
    watch_recovery();
    // The job's last event: attempts, faults and the effective training time, however it ends.
    struct Effective {
      double wall, productive;
    };
    auto write_summary = [&](const std::string& end) {
      const Effective t{WallSeconds() - driver_start, ProductiveSeconds(run_dir)};
      events.Write("summary", [&](metrics::JsonObject& e) {
        e.Add("attempts", attempt + 1).Add("faults", faults).Add("wall_s", t.wall).Add("productive_s", t.productive);
        e.Add("effective_training_time_ratio", t.wall > 0 ? t.productive / t.wall : 0).Add("end", end);
      });
      return t;
    };
    if (result.end || !result.error.ok()) {
      const auto [wall, productive] =
          write_summary(result.end ? std::to_string(ExitCode(*result.end)) : result.error.message());
      if (faults > 0 || attempt > 0) {
        LogInfo(
            "effective training time: {:.1f} s of steps in {:.1f} s of wall time ({:.0f}%), {} fault{} over {} "
            "attempt{}",
            productive, wall, wall > 0 ? 100 * productive / wall : 0, faults, faults == 1 ? "" : "s", attempt + 1,
            attempt == 0 ? "" : "s");
      }
      if (redis) {
        Status stopped = redis->Stop();  // after the ranks: they needed it for their last checkpoint
        if (!stopped.ok()) LogWarn("stopping the embedded redis-server: {}", stopped.message());
      }
      if (!result.error.ok()) return result.error;
      return *result.end;
    }
    // A fault: record it, decide, and restart from the newest checkpoint.
    Fault& f = *result.fault;
    ++faults;
    const double detected_at = WallSeconds();
    const int64_t reached = std::max<int64_t>(monitor ? monitor->max_step() : -1, LastTrainStep(run_dir));
    // Where a restart would resume. At train.steps, the last checkpoint was committed before the fault (a rank
    // lost on its way out): the job is complete, and an attempt with no step to take is not launched.
    const int64_t newest = RestartStep(spec);
    auto write_fault = [&](const std::string& action) {
      events.Write("fault", [&](metrics::JsonObject& e) {
        e.Add("attempt", attempt).Add("kind", f.kind).Add("rank", f.rank).Add("host", f.host).Add("detail", f.detail);
        e.Add("detect_latency_s", f.detect_latency_s).Add("steps_reached", reached).Add("action", action);
      });
    };
    if (newest >= spec.train.steps) {
      write_fault("none: complete");
      write_summary(std::to_string(ExitCode(JobEnd::kCompleted)));
      if (redis) redis->Stop().IgnoreError();
      LogWarn(
          "{} in attempt {} after its last checkpoint: {}. The job is complete: {}/{} holds step {} = train.steps, "
          "so no attempt is restarted",
          f.kind, attempt, f.detail, spec.checkpoint.dir, checkpoint::StepDirName(newest), newest);
      return JobEnd::kCompleted;
    }
    std::string action = "restart";
    std::string stop_reason;
    if (f.host_fault && !f.host.empty() && ++host_faults[f.host][f.kind] >= 2) {
      // The same fault twice on one host: the host is bad.
      const int spare = alloc ? static_cast<int>(alloc->nodes.size() - excluded.size()) - fit->nodes : 0;
      if (alloc && spare > 0) {
        excluded.push_back(f.host);
        action = fmt::format("restart without host {}", f.host);
      } else {
        stop_reason = fmt::format(
            "the same fault ({}) happened twice on host {}, and {}", f.kind, f.host,
            alloc ? "the allocation has no spare node to run without it" : "the local launcher has no other host");
      }
    }
    if (stop_reason.empty() && attempt >= spec.fault.max_restarts) {
      stop_reason = fmt::format("{} fault{} and fault.max_restarts = {}", faults, faults == 1 ? "" : "s",
                                spec.fault.max_restarts);
    }
    if (!stop_reason.empty()) action = "stop";
    write_fault(action);
    if (stop_reason.empty())
      recovered += fmt::format("{}{} in attempt {}", recovered.empty() ? "" : ", ", f.kind, attempt);
    if (!stop_reason.empty()) {
      write_summary(stop_reason);
      if (redis) redis->Stop().IgnoreError();
      return Aborted("{} in attempt {}: {}. Stopping: {}{}. {}", f.kind, attempt, f.detail, stop_reason,
                     recovered.empty() ? std::string() : fmt::format(" (recovered before: {})", recovered),
                     newest >= 0 ? fmt::format("The checkpoints are intact (newest: step {}): `megascale resume` "
                                               "continues from it once the cause is fixed",
                                               newest)
                                 : std::string("No checkpoint was committed yet"));
    }
    // Back off (longer after each fault), still honouring the job's stop signals.
    const double backoff = std::min(60.0, spec.fault.restart_backoff_s * (1 << std::min(attempt, 10)));
    LogWarn("{} in attempt {}: {}; {} in {:.0f} s from the newest checkpoint ({} of fault.max_restarts = {})", f.kind,
            attempt, f.detail, action, backoff, attempt + 1, spec.fault.max_restarts);
    for (const double until = NowSeconds() + backoff; NowSeconds() < until;) {
      const SignalCounts sig = TakeSignals();
      if (sig.terminate || sig.interrupt) {
        if (redis) redis->Stop().IgnoreError();
        LogWarn("stopped by {} while waiting to restart; the checkpoints are intact",
                sig.terminate ? "SIGTERM" : "SIGINT");
        return sig.terminate ? JobEnd::kSavedOnSignal : JobEnd::kInterrupted;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    resume_step = newest;  // the ranks are gone: nothing was committed while the driver waited
    recovering = Recovery{f.kind, detected_at, reached, resume_step};
  }
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
  const double C = m.hidden, F = m.ffn_hidden, V = static_cast<double>(m.padded_vocab()), T = m.seq_len, L = m.layers;
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
  if (options.resume_step >= spec.train.steps) {
    // Nothing to train: no rank is launched (a rank with no step to take would only wait on the others).
    LogInfo(
        "nothing to train: the newest checkpoint, {}/{}, is at step {} and train.steps = {}; the job is complete "
        "(raise train.steps to train on from it)",
        spec.checkpoint.dir, checkpoint::StepDirName(options.resume_step), options.resume_step, spec.train.steps);
    return JobEnd::kCompleted;
  }
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
