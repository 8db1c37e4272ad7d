// megascale init-test: simulated (one thread and one connection per rank) and real (one process
// per rank, Gloo communicators) runs of the bootstrap, for the megascale and baseline initializers.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include "bootstrap/bootstrap.h"
#include "cluster/cluster.h"

extern char** environ;

namespace ms::bootstrap {
namespace {

constexpr int64_t kBaselineAutoOps = 3'000'000;  // auto cap of the baseline's barrier traffic

struct RankRecord {
  std::vector<PhaseTiming> phases;
  Status status;
};

// Aggregates per-rank phases by name (in first-seen order); phases named in `excluded` are shown
// but not counted in the total.
ModeReport Aggregate(const std::string& initializer, const std::vector<std::vector<PhaseTiming>>& ranks,
                     const std::vector<std::string>& excluded = {}) {
  ModeReport m;
  m.initializer = initializer;
  std::vector<std::string> order;
  struct Acc {
    double start = 1e300, end = -1e300, sum = 0;
    int64_t n = 0, ops = 0, bytes = 0;
  };
  std::map<std::string, Acc> acc;
  Acc total;
  for (auto& phases : ranks) {
    for (auto& p : phases) {
      if (!acc.count(p.name)) order.push_back(p.name);
      Acc& a = acc[p.name];
      a.start = std::min(a.start, p.start);
      a.end = std::max(a.end, p.end);
      a.sum += p.end - p.start;
      a.n++;
      a.ops += p.ops;
      a.bytes += p.bytes;
      if (std::find(excluded.begin(), excluded.end(), p.name) == excluded.end()) {
        total.start = std::min(total.start, p.start);
        total.end = std::max(total.end, p.end);
        total.ops += p.ops;
        total.bytes += p.bytes;
      }
    }
  }
  for (auto& name : order) {
    Acc& a = acc[name];
    m.phases.push_back({name, a.end - a.start, a.n ? a.sum / a.n * 1000.0 : 0, a.ops, a.bytes});
  }
  m.total = {"total", total.end > total.start ? total.end - total.start : 0, 0, total.ops, total.bytes};
  double rank_sum = 0;
  for (auto& phases : ranks) {
    double s = 1e300, e = -1e300;
    for (auto& p : phases) {
      if (std::find(excluded.begin(), excluded.end(), p.name) != excluded.end()) continue;
      s = std::min(s, p.start);
      e = std::max(e, p.end);
    }
    if (e > s) rank_sum += e - s;
  }
  m.total.mean_rank_ms = ranks.empty() ? 0 : rank_sum / ranks.size() * 1000.0;
  return m;
}

int TotalGroups(const ParallelGrid& grid) {
  int n = 0;
  for (GroupKind k : kAllGroupKinds) n += grid.NumGroups(k);
  return n;
}

// ---- simulated ----------------------------------------------------------------------------

struct SimShared {
  const InitTestOptions* opt;
  ParallelGrid grid;
  StoreOptions store_options;
  GroupExchangeOptions ex;
  std::vector<RankRecord>* records;
  std::atomic<int> connected{0}, registered{0}, finished{0}, failed{0};
};

struct SimGate {
  std::atomic<bool> open{false};
};

struct SimArg {
  SimShared* shared;
  SimGate* gate;
  int rank;
};

void SimRank(SimShared& sh, int rank) {
  RankRecord& rec = (*sh.records)[rank];
  auto fail = [&](Status s) {
    rec.status = s.WithContext(fmt::format("simulated rank {}", rank));
    sh.failed++;
    sh.finished++;
  };
  PhaseTiming connect{"connect", NowSeconds(), 0, 0, 0};
  auto store = ConnectRedisStore(sh.store_options);
  if (!store.ok()) return fail(store.status());
  connect.end = NowSeconds();
  connect.ops = (*store)->stats().ops;
  connect.bytes = (*store)->stats().bytes();
  rec.phases.push_back(connect);
  sh.connected++;
  RankInfo me;
  me.rank = rank;
  me.hostname = fmt::format("sim-host-{}", rank / sh.opt->ranks_per_host);
  me.local_rank = rank % sh.opt->ranks_per_host;
  me.device = me.local_rank;
  me.pid = static_cast<int>(getpid());
  me.address = "127.0.0.1";
  auto topo = Rendezvous(**store, me, sh.grid.world(), sh.grid, sh.opt->timeout);
  if (!topo.ok()) return fail(topo.status());
  for (auto& p : topo->phases) rec.phases.push_back(p);
  sh.registered++;
  auto ids = ExchangeGroupIds(**store, sh.grid, rank, sh.ex);
  if (!ids.ok()) return fail(ids.status());
  for (auto& p : ids->phases) rec.phases.push_back(p);
  sh.finished++;
}

void* SimThread(void* p) {
  SimArg* a = static_cast<SimArg*>(p);
  a->gate->open.wait(false);  // all threads exist before any rank starts (the creator is not starved)
  SimRank(*a->shared, a->rank);
  return nullptr;
}

Result<ModeReport> RunSimulated(const InitTestOptions& opt, const ParallelGrid& grid, const std::string& url,
                                const std::string& job, int attempt, bool baseline) {
  const int n = opt.ranks;
  std::vector<RankRecord> records(n);
  SimShared sh;
  sh.opt = &opt;
  sh.grid = grid;
  sh.records = &records;
  sh.store_options.url = url;
  sh.store_options.job_id = job;
  sh.store_options.attempt = attempt;
  sh.store_options.op_timeout = opt.timeout;
  sh.store_options.connect_timeout = Millis(std::min<int64_t>(opt.timeout.count(), 10000));
  sh.ex.timeout = opt.timeout;
  sh.ex.id_bytes = opt.id_bytes;
  sh.ex.baseline = baseline;
  const int total_groups = TotalGroups(grid);
  int cap = opt.baseline_max_groups;
  if (baseline && cap == 0 && static_cast<int64_t>(n) * total_groups > kBaselineAutoOps) {
    cap = static_cast<int>(std::max<int64_t>(1, kBaselineAutoOps / n));
  }
  if (cap >= total_groups) cap = 0;
  sh.ex.baseline_max_groups = baseline ? cap : 0;

  const char* name = baseline ? "baseline" : "megascale";
  if (opt.progress) {
    std::fprintf(stderr, "init-test: %s initializer, %d simulated ranks (%s)%s\n", name, n, grid.ToString().c_str(),
                 baseline && cap ? fmt::format(", {} of {} groups", cap, total_groups).c_str() : "");
  }
  pthread_attr_t attr;
  if (int e = pthread_attr_init(&attr); e != 0) return ErrnoError("pthread_attr_init", e);
  if (int e = pthread_attr_setstacksize(&attr, 256 * 1024); e != 0) return ErrnoError("pthread_attr_setstacksize", e);
  std::vector<pthread_t> threads;
  std::vector<SimArg> args(n);
  threads.reserve(n);
  Status spawn_error;
  SimGate gate;
  for (int r = 0; r < n; ++r) {
    args[r] = {&sh, &gate, r};
    pthread_t t;
    int e = pthread_create(&t, &attr, &SimThread, &args[r]);
    if (e != 0) {
      spawn_error = ErrnoError(fmt::format("starting simulated rank {} of {} (thread)", r, n), e);
      break;
    }
    threads.push_back(t);
  }
  pthread_attr_destroy(&attr);
  const double t0 = NowSeconds();
  gate.open.store(true);
  gate.open.notify_all();
  // Progress while the ranks run.
  double last_print = NowSeconds();
  while (sh.finished.load() < static_cast<int>(threads.size())) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (opt.progress && NowSeconds() - last_print > 1.0) {
      last_print = NowSeconds();
      std::fprintf(stderr, "init-test: %s %.1fs: %d connected, %d through rendezvous, %d done, %d failed of %d\n", name,
                   last_print - t0, sh.connected.load(), sh.registered.load(), sh.finished.load(), sh.failed.load(), n);
    }
  }
  for (pthread_t t : threads) pthread_join(t, nullptr);
  if (!spawn_error.ok()) {
    return spawn_error.WithContext("simulated ranks need one thread each; check `ulimit -u` and memory");
  }
  for (int r = 0; r < n; ++r) {
    if (!records[r].status.ok()) {
      return records[r].status.WithContext(fmt::format("{} of {} simulated ranks failed; first", sh.failed.load(), n));
    }
  }
  std::vector<std::vector<PhaseTiming>> phases(n);
  for (int r = 0; r < n; ++r) phases[r] = std::move(records[r].phases);
  ModeReport m = Aggregate(name, phases);
  if (baseline && cap > 0) {
    // Extrapolate the group phases linearly in the number of groups (each costs one global barrier).
    double group_time = 0;
    int64_t group_ops = 0, group_bytes = 0;
    double setup_time = 0;
    for (auto& p : m.phases) {
      bool is_group = p.name != "connect" && p.name != "register" && p.name != "topology";
      (is_group ? group_time : setup_time) += p.seconds;
      if (is_group) {
        group_ops += p.ops;
        group_bytes += p.bytes;
      }
    }
    const double f = static_cast<double>(total_groups) / cap;
    m.note = fmt::format("baseline stopped after {} of {} groups ({:.2f} s, {} ops); total extrapolated linearly", cap,
                         total_groups, m.total.seconds, m.total.ops);
    m.total.seconds = m.total.seconds + group_time * (f - 1);
    m.total.ops = m.total.ops + static_cast<int64_t>(group_ops * (f - 1));
    m.total.bytes = m.total.bytes + static_cast<int64_t>(group_bytes * (f - 1));
    m.total.name = "total (extrapolated)";
    (void)setup_time;
  }
  if (opt.progress) std::fprintf(stderr, "init-test: %s done in %.2f s\n", name, NowSeconds() - t0);
  return m;
}

// ---- real -----------------------------------------------------------------------------------

std::string StripPassword(const std::string& url) {
  auto ep = ParseRedisUrl(url);
  if (!ep.ok()) return url;
  return fmt::format("redis://{}:{}/{}", ep->host, ep->port, ep->db);
}

Result<pid_t> Spawn(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env,
                    const std::string& log_path) {
  std::vector<std::string> env_store;
  for (char** e = environ; *e; ++e) {
    std::string_view v(*e);
    bool overridden = false;
    for (auto& x : extra_env) {
      if (v.substr(0, v.find('=') + 1) == std::string_view(x).substr(0, x.find('=') + 1)) overridden = true;
    }
    if (!overridden) env_store.emplace_back(v);
  }
  for (auto& x : extra_env) env_store.push_back(x);
  std::vector<char*> envp, args;
  for (auto& s : env_store) envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_copy = argv;
  for (auto& s : argv_copy) args.push_back(s.data());
  args.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return ErrnoError("fork for a worker", errno);
  if (pid == 0) {
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
    }
    execve(args[0], args.data(), envp.data());
    _exit(127);
  }
  return pid;
}

Result<ModeReport> RunReal(const InitTestOptions& opt, const ParallelGrid& grid, const std::string& url,
                           const std::string& job, int attempt, bool baseline, std::vector<std::string>* checks) {
  if (opt.worker_command.empty()) {
    return FailedPrecondition("real mode needs a worker command (the megascale binary passes its own path)");
  }
  const char* name = baseline ? "baseline" : "megascale";
  // Workers write their results here: /tmp for local processes, the current directory (which a
  // cluster shares between its nodes, unlike /tmp) for an srun step.
  std::string templ = opt.launcher == "srun" ? "./.megascale-init-test-XXXXXX" : "/tmp/megascale-init-test-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return ErrnoError(fmt::format("mkdtemp {}", templ), errno);
  const std::string dir = templ;
  auto ep = ParseRedisUrl(url);
  if (!ep.ok()) return ep.status();
  std::vector<std::string> env;
  if (!ep->password.empty()) env.push_back("MEGASCALE_REDIS_PASSWORD=" + ep->password);
  InitTestWorkerOptions w;
  w.world = opt.ranks;
  w.tp = grid.tp;
  w.pp = grid.pp;
  w.redis_url = StripPassword(url);
  w.job_id = job;
  w.attempt = attempt;
  w.baseline = baseline;
  w.timeout = opt.timeout;
  w.result_dir = dir;
  if (opt.progress)
    std::fprintf(stderr, "init-test: %s initializer, %d worker processes (%s, %s)\n", name, opt.ranks,
                 grid.ToString().c_str(), opt.launcher.c_str());
  std::vector<pid_t> pids;
  std::vector<std::string> logs;
  Status status;
  auto kill_all = [&] {
    for (pid_t p : pids) {
      if (p > 0) kill(p, SIGKILL);
    }
    for (pid_t& p : pids) {
      if (p > 0) waitpid(p, nullptr, 0);
      p = -1;
    }
  };
  if (opt.launcher == "srun") {
    w.rank = -1;  // from SLURM_PROCID
    std::vector<std::string> argv = {"srun", fmt::format("--ntasks={}", opt.ranks), "--kill-on-bad-exit=1"};
    MS_ASSIGN_OR_RETURN(argv[0], FindExecutable("srun"));
    for (auto& a : opt.worker_command) argv.push_back(a);
    for (auto& a : WorkerArgs(w)) argv.push_back(a);
    logs.push_back(dir + "/srun.log");
    MS_ASSIGN_OR_RETURN(pid_t p, Spawn(argv, env, logs.back()));
    pids.push_back(p);
  } else if (opt.launcher == "local") {
    for (int r = 0; r < opt.ranks; ++r) {
      w.rank = r;
      std::vector<std::string> argv = opt.worker_command;
      for (auto& a : WorkerArgs(w)) argv.push_back(a);
      logs.push_back(fmt::format("{}/rank-{}.log", dir, r));
      auto p = Spawn(argv, env, logs.back());
      if (!p.ok()) {
        status = p.status();
        break;
      }
      pids.push_back(*p);
    }
  } else {
    return InvalidArgument("--launcher must be local or srun, got '{}'", opt.launcher);
  }
  // Wait for every worker, with a deadline; on the first failure give the rest a moment, then kill.
  const double deadline = NowSeconds() + opt.timeout.count() / 1000.0 + 30.0;
  size_t alive = pids.size();
  double first_failure = 0;
  while (alive > 0 && status.ok()) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (pids[i] <= 0) continue;
      int ws = 0;
      pid_t r = waitpid(pids[i], &ws, WNOHANG);
      if (r == 0) continue;
      pids[i] = -1;
      --alive;
      if (r < 0 || !WIFEXITED(ws) || WEXITSTATUS(ws) != 0) {
        auto log = ReadFile(logs[i]);
        std::string text = log.ok() ? *log : "(no log)";
        if (text.size() > 2000) text = "..." + text.substr(text.size() - 2000);
        if (status.ok() && first_failure == 0) {
          first_failure = NowSeconds();
          status = Aborted(
              "worker {} ({}) failed ({}): {}", i, logs[i],
              WIFEXITED(ws) ? fmt::format("exit {}", WEXITSTATUS(ws)) : fmt::format("signal {}", WTERMSIG(ws)), text);
        }
      }
    }
    if (NowSeconds() > deadline) status = Timeout("workers still running after {} ms", opt.timeout.count());
    if (alive > 0 && status.ok()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill_all();
  if (!status.ok()) {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
    return status;
  }
  // Collect the results.
  std::vector<std::vector<PhaseTiming>> phases(opt.ranks);
  for (int r = 0; r < opt.ranks; ++r) {
    auto text = ReadFile(fmt::format("{}/rank-{}.txt", dir, r));
    if (!text.ok()) return text.status().WithContext(fmt::format("reading the result of worker {}", r));
    size_t pos = 0;
    while (pos < text->size()) {
      size_t end = text->find('\n', pos);
      if (end == std::string::npos) end = text->size();
      std::string_view line(text->data() + pos, end - pos);
      pos = end + 1;
      if (line.starts_with("check\t")) {
        checks->push_back(fmt::format("{} rank {}: {}", name, r, line.substr(6)));
      } else if (line.starts_with("phase\t")) {
        PhaseTiming p;
        char nm[64] = {0};
        long long ops = 0, bytes = 0;
        std::string l(line.substr(6));
        if (std::sscanf(l.c_str(), "%63s %lf %lf %lld %lld", nm, &p.start, &p.end, &ops, &bytes) == 5) {
          p.name = nm;
          p.ops = ops;
          p.bytes = bytes;
          phases[r].push_back(p);
        }
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return Aggregate(name, phases, {"allreduce_check"});
}

std::string PhaseJson(const PhaseReport& p) {
  return fmt::format(R"({{"phase": "{}", "seconds": {:.6f}, "mean_rank_ms": {:.3f}, "store_ops": {}, "bytes": {}}})",
                     JsonEscape(p.name), p.seconds, p.mean_rank_ms, p.ops, p.bytes);
}

}  // namespace

Result<InitTestReport> RunInitTest(const InitTestOptions& opt) {
  if (opt.ranks < 1) return InvalidArgument("--ranks must be >= 1, got {}", opt.ranks);
  MS_ASSIGN_OR_RETURN(ParallelGrid grid, ParallelGrid::Make(opt.ranks, opt.tp, opt.pp));
  if (opt.mode != "simulated" && opt.mode != "real") {
    return InvalidArgument("--mode must be simulated or real, got '{}'", opt.mode);
  }
  if (opt.ranks_per_host < 1) return InvalidArgument("--ranks-per-host must be >= 1");
  if (opt.timeout.count() <= 0) return InvalidArgument("--timeout must be > 0");
  if (opt.mode == "simulated" && opt.ranks > 19000) {
    return InvalidArgument(
        "simulated mode holds one connection per rank; {} ranks exceed the ~19,000 sockets one "
        "process may open here (ulimit -n)",
        opt.ranks);
  }
  if (opt.mode == "real" && opt.ranks > 512) {
    return InvalidArgument(
        "real mode starts one process per rank with full-mesh Gloo groups; {} is too many for one "
        "machine (use simulated mode)",
        opt.ranks);
  }
  InitTestReport report;
  report.ranks = opt.ranks;
  report.grid = grid;
  report.mode = opt.mode;

  std::optional<EmbeddedRedis> embedded;
  std::string url = opt.redis_url;
  if (url.empty()) {
    EmbeddedRedisOptions eo;
    eo.max_clients = std::min(opt.ranks + 256, 19900);
    if (opt.mode == "real" && opt.launcher == "srun") {
      // The tasks of the step run on the allocation's nodes: listen where they can reach.
      MS_ASSIGN_OR_RETURN(auto alloc, cluster::ReadSlurmAllocation());
      if (!alloc) return FailedPrecondition("--launcher srun needs a Slurm allocation (sbatch or salloc)");
      MS_ASSIGN_OR_RETURN(eo.bind_address, cluster::AddressTowardNodes(alloc->nodes));
    }
    MS_ASSIGN_OR_RETURN(EmbeddedRedis r, EmbeddedRedis::Start(eo));
    embedded.emplace(std::move(r));
    // Internal to this process and its workers (the password is stripped before anything is printed).
    url = fmt::format("redis://:{}@{}:{}/0", embedded->password(), embedded->address(), embedded->port());
  } else {
    MS_RETURN_IF_ERROR(ParseRedisUrl(url).status());
  }
  // A fresh job id per run: runs against a shared Redis never see each other's keys.
  Rng rng(static_cast<uint64_t>(NowSeconds() * 1e9), static_cast<uint64_t>(getpid()));
  const std::string job = fmt::format("{}-{:08x}", opt.job_id, rng.NextU64() & 0xffffffffu);
  StoreOptions cleanup_opt;
  cleanup_opt.url = url;
  cleanup_opt.job_id = job;

  std::vector<bool> inits = {false};
  if (opt.baseline) inits.push_back(true);
  for (size_t i = 0; i < inits.size(); ++i) {
    const int attempt = static_cast<int>(i);
    Result<ModeReport> run = opt.mode == "simulated" ? RunSimulated(opt, grid, url, job, attempt, inits[i])
                                                     : RunReal(opt, grid, url, job, attempt, inits[i], &report.checks);
    // Remove this run's keys (also after a failure), so a long-lived Redis does not fill up.
    cleanup_opt.attempt = attempt;
    auto cleaner = ConnectRedisStore(cleanup_opt);
    if (cleaner.ok()) {
      auto d = (*cleaner)->DeletePrefix("");
      if (!d.ok()) LogWarn("init-test: cleaning up keys: {}", d.status().message());
    }
    if (!run.ok()) return run.status().WithContext(fmt::format("init-test ({} mode)", opt.mode));
    report.runs.push_back(std::move(run).value());
  }
  if (embedded) MS_RETURN_IF_ERROR(embedded->Stop());
  if (!opt.json_path.empty()) {
    MS_RETURN_IF_ERROR_CTX(WriteFileAtomic(opt.json_path, ToJson(report)), "writing {}", opt.json_path);
  }
  return report;
}

std::string FormatTable(const InitTestReport& report) {
  std::string out =
      fmt::format("init-test: {} ranks, layout {}, {} mode\n", report.ranks, report.grid.ToString(), report.mode);
  out += fmt::format("{:<11} {:<21} {:>10} {:>14} {:>12} {:>14}\n", "initializer", "phase", "time (s)",
                     "rank mean (ms)", "store ops", "bytes");
  for (auto& run : report.runs) {
    for (auto& p : run.phases) {
      out += fmt::format("{:<11} {:<21} {:>10.3f} {:>14.2f} {:>12} {:>14}\n", run.initializer, p.name, p.seconds,
                         p.mean_rank_ms, p.ops, p.bytes);
    }
    out += fmt::format("{:<11} {:<21} {:>10.3f} {:>14.2f} {:>12} {:>14}\n", run.initializer, run.total.name,
                       run.total.seconds, run.total.mean_rank_ms, run.total.ops, run.total.bytes);
    if (!run.note.empty()) out += fmt::format("  note: {}\n", run.note);
  }
  if (report.runs.size() == 2 && report.runs[0].total.seconds > 0) {
    out += fmt::format("baseline / megascale: {:.1f}x the time, {:.1f}x the store operations\n",
                       report.runs[1].total.seconds / report.runs[0].total.seconds,
                       static_cast<double>(report.runs[1].total.ops) / std::max<int64_t>(1, report.runs[0].total.ops));
  }
  if (!report.checks.empty()) out += fmt::format("all-reduce checks: {} passed\n", report.checks.size());
  return out;
}

std::string ToJson(const InitTestReport& report) {
  std::string out = fmt::format(R"({{"ranks": {}, "tp": {}, "pp": {}, "dp": {}, "mode": "{}", "runs": [)", report.ranks,
                                report.grid.tp, report.grid.pp, report.grid.dp, JsonEscape(report.mode));
  for (size_t i = 0; i < report.runs.size(); ++i) {
    const ModeReport& r = report.runs[i];
    out += fmt::format(R"({}{{"initializer": "{}", "note": "{}", "total": {}, "phases": [)", i ? ", " : "",
                       JsonEscape(r.initializer), JsonEscape(r.note), PhaseJson(r.total));
    for (size_t j = 0; j < r.phases.size(); ++j) out += (j ? ", " : "") + PhaseJson(r.phases[j]);
    out += "]}";
  }
  out += R"(], "checks": [)";
  for (size_t i = 0; i < report.checks.size(); ++i) {
    out += fmt::format(R"({}"{}")", i ? ", " : "", JsonEscape(report.checks[i]));
  }
  out += "]}\n";
  return out;
}

std::vector<std::string> WorkerArgs(const InitTestWorkerOptions& w) {
  std::vector<std::string> a = {"--worker-rank",
                                std::to_string(w.rank),
                                "--worker-world",
                                std::to_string(w.world),
                                "--tp",
                                std::to_string(w.tp),
                                "--pp",
                                std::to_string(w.pp),
                                "--redis",
                                w.redis_url,
                                "--job-id",
                                w.job_id,
                                "--worker-attempt",
                                std::to_string(w.attempt),
                                "--timeout",
                                fmt::format("{:.3f}", w.timeout.count() / 1000.0),
                                "--worker-results",
                                w.result_dir};
  if (w.baseline) a.push_back("--worker-baseline");
  return a;
}

int RunInitTestWorker(const InitTestWorkerOptions& w) {
  auto run = [&]() -> Status {
    MS_ASSIGN_OR_RETURN(RankInfo me, RankInfoFromEnv(w.rank));
    if (w.rank >= 0) me.rank = w.rank;
    if (!GetEnv("MEGASCALE_LISTEN_ADDRESS")) {  // this host's address toward the store's
      MS_ASSIGN_OR_RETURN(RedisEndpoint ep, ParseRedisUrl(w.redis_url));
      MS_ASSIGN_OR_RETURN(me.address, cluster::LocalAddressToward(ep.host));
    }
    SetLogRank(me.rank);
    MS_ASSIGN_OR_RETURN(ParallelGrid grid, ParallelGrid::Make(w.world, w.tp, w.pp));
    StoreOptions so;
    so.url = w.redis_url;
    so.job_id = w.job_id;
    so.attempt = w.attempt;
    so.op_timeout = w.timeout;
    std::vector<PhaseTiming> phases;
    PhaseTiming connect{"connect", NowSeconds(), 0, 0, 0};
    MS_ASSIGN_OR_RETURN(std::unique_ptr<Store> store, ConnectRedisStore(so));
    connect.end = NowSeconds();
    connect.ops = store->stats().ops;
    connect.bytes = store->stats().bytes();
    phases.push_back(connect);
    MS_ASSIGN_OR_RETURN(Topology topo, Rendezvous(*store, me, w.world, grid, w.timeout));
    for (auto& p : topo.phases) phases.push_back(p);
    ProcessGroupOptions po;
    po.timeout = w.timeout;
    po.listen_address = me.address;
    po.baseline = w.baseline;
    MS_ASSIGN_OR_RETURN(ProcessGroups groups, CreateProcessGroups(*store, topo, po));
    for (auto& p : groups.phases) phases.push_back(p);
    PhaseTiming check{"allreduce_check", NowSeconds(), 0, 0, 0};
    MS_ASSIGN_OR_RETURN(std::vector<std::string> lines, CheckGroupsAllReduce(groups, grid, me.rank, w.timeout));
    // Nobody closes its connections while a peer may still be in its last all-reduce.
    MS_RETURN_IF_ERROR(StoreBarrier(*store, "worker/exit", w.world, w.timeout));
    check.end = NowSeconds();
    phases.push_back(check);
    std::string text;
    for (auto& p : phases) {
      text += fmt::format("phase\t{} {:.9f} {:.9f} {} {}\n", p.name, p.start, p.end, p.ops, p.bytes);
    }
    for (auto& l : lines) text += "check\t" + l + "\n";
    return WriteFileAtomic(fmt::format("{}/rank-{}.txt", w.result_dir, me.rank), text);
  };
  Status s = run();
  if (!s.ok()) {
    std::fprintf(stderr, "error: init-test worker %d: %s\n", w.rank, s.message().c_str());
    return 1;
  }
  return 0;
}

}  // namespace ms::bootstrap
