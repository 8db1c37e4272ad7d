// The driver (launch and supervise local ranks) and the worker entry point.
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "bootstrap/bootstrap.h"
#if defined(MS_HAVE_NCCL)
#include "comm/nccl_comm.h"
#endif
#include "runner/checkpointing.h"
#include "runner/runner.h"

extern char** environ;

namespace ms::runner {
namespace {

std::atomic<int> g_driver_signal{0};
extern "C" void OnDriverSignal(int sig) {
  g_driver_signal.store(sig);
}

std::string RandomHex(int bytes) {
  Rng rng(static_cast<uint64_t>(NowSeconds() * 1e9) ^ (static_cast<uint64_t>(getpid()) << 32));
  std::string s;
  for (int i = 0; i < bytes; ++i) s += fmt::format("{:02x}", static_cast<unsigned>(rng.NextU64() & 0xff));
  return s;
}

struct Child {
  int rank;
  pid_t pid;
  bool done = false;
  int status = 0;
};

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "unknown status";
}

// Stops every child still running: SIGTERM, then SIGKILL after `grace`.
void StopChildren(std::vector<Child>& children, double grace) {
  for (auto& c : children) {
    if (!c.done) kill(c.pid, SIGTERM);
  }
  const double deadline = NowSeconds() + grace;
  for (;;) {
    bool all = true;
    for (auto& c : children) {
      if (c.done) continue;
      pid_t r = waitpid(c.pid, &c.status, WNOHANG);
      if (r == c.pid) {
        c.done = true;
      } else {
        all = false;
      }
    }
    if (all) return;
    if (NowSeconds() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (auto& c : children) {
    if (c.done) continue;
    kill(c.pid, SIGKILL);
    if (waitpid(c.pid, &c.status, 0) == c.pid) c.done = true;
  }
}

Result<pid_t> SpawnWorker(const std::string& exe, const std::vector<std::string>& args,
                          const std::vector<std::string>& env) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> envs;
  for (char** e = environ; *e; ++e) {
    std::string_view kv(*e);
    bool overridden = false;
    for (const auto& o : env) {
      if (kv.substr(0, kv.find('=') + 1) == std::string_view(o).substr(0, o.find('=') + 1)) overridden = true;
    }
    if (!overridden) envs.emplace_back(kv);
  }
  envs.insert(envs.end(), env.begin(), env.end());
  std::vector<char*> envp;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t pid = fork();
  if (pid < 0) return ErrnoError("fork of a worker", errno);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // a rank never outlives its driver
    execve(exe.c_str(), argv.data(), envp.data());
    std::fprintf(stderr, "error: cannot exec %s: %s\n", exe.c_str(), std::strerror(errno));
    _exit(127);
  }
  return pid;
}

Status RunLocalRanks(const config::JobSpec& spec, const TrainOptions& options) {
  const int world = config::WorldSize(spec.parallel);
  const std::string& run_dir = spec.log.run_dir;
  MS_RETURN_IF_ERROR_CTX(MakeDirs(run_dir), "creating run directory log.run_dir={}", run_dir);
  const std::string spec_path = run_dir + "/job.yaml";
  MS_RETURN_IF_ERROR(WriteFileAtomic(spec_path, config::ToYaml(spec)));

  std::optional<bootstrap::EmbeddedRedis> redis;
  std::string url = spec.runtime.redis;
  if (url.empty()) {
    bootstrap::EmbeddedRedisOptions ro;
    ro.max_clients = std::max(1000, 4 * world);
    // Its pid file and log live (and, after a crash, stay) in the run directory; redis-server
    // changes into its directory, so the path must be absolute.
    char abs_dir[PATH_MAX];
    if (realpath(run_dir.c_str(), abs_dir) == nullptr) return ErrnoError(fmt::format("resolving {}", run_dir), errno);
    ro.temp_parent = abs_dir;
    MS_ASSIGN_OR_RETURN(auto r, bootstrap::EmbeddedRedis::Start(ro));
    redis.emplace(std::move(r));
    url = redis->url();
    LogInfo("started redis-server (pid {}) on 127.0.0.1:{} for the rank bootstrap", redis->pid(), redis->port());
  }
  const std::string job_id = fmt::format("{}-{}", spec.name, RandomHex(6));
  const int threads = spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, NumCores() / world);
  char exe[4096];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (n < 0) return ErrnoError("readlink /proc/self/exe", errno);
  exe[n] = 0;

  struct sigaction sa {
  }, old_int{}, old_term{};
  sa.sa_handler = OnDriverSignal;
  sigemptyset(&sa.sa_mask);
  g_driver_signal = 0;
  struct sigaction old_usr1 {};
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  sigaction(SIGUSR1, &sa, &old_usr1);
  struct Restore {
    struct sigaction* i;
    struct sigaction* t;
    struct sigaction* u;
    ~Restore() {
      sigaction(SIGINT, i, nullptr);
      sigaction(SIGTERM, t, nullptr);
      sigaction(SIGUSR1, u, nullptr);
    }
  } restore{&old_int, &old_term, &old_usr1};

  LogInfo("launching {} local ranks ({} threads each), job id {}", world, threads, job_id);
  std::vector<Child> children;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {exe, "worker", spec_path};
    if (!options.progress || r != 0) args.push_back("--no-progress");
    if (options.resume) args.push_back("--resume");
    if (!options.dump_params_dir.empty()) {
      args.push_back("--dump-params");
      args.push_back(options.dump_params_dir);
    }
    std::vector<std::string> env = {
        fmt::format("MEGASCALE_RANK={}", r),        fmt::format("MEGASCALE_WORLD={}", world),
        fmt::format("MEGASCALE_LOCAL_RANK={}", r),  fmt::format("MEGASCALE_LOCAL_WORLD={}", world),
        fmt::format("MEGASCALE_STORE_URL={}", url), fmt::format("MEGASCALE_JOB_ID={}", job_id),
        fmt::format("OMP_NUM_THREADS={}", threads)};
    auto pid = SpawnWorker(exe, args, env);
    if (!pid.ok()) {
      StopChildren(children, 5.0);
      return pid.status();
    }
    children.push_back({r, *pid});
  }
  // Supervise: the first failure stops the job.
  Status result;
  int remaining = world;
  while (remaining > 0) {
    if (int sig = g_driver_signal.exchange(0)) {
      if (sig == SIGUSR1) {
        LogInfo("SIGUSR1: asking all {} ranks for a checkpoint", world);
        for (auto& c : children) {
          if (!c.done) kill(c.pid, SIGUSR1);
        }
        continue;
      }
      // Ranks finish their step (SIGTERM: and save a checkpoint), then exit.
      LogWarn("driver got signal {} ({}): stopping all {} ranks", sig, strsignal(sig), world);
      for (auto& c : children) {
        if (!c.done) kill(c.pid, sig);
      }
      const double deadline = NowSeconds() + 120.0;
      bool clean = true;
      for (auto& c : children) {
        while (!c.done && NowSeconds() < deadline) {
          if (waitpid(c.pid, &c.status, WNOHANG) == c.pid) {
            c.done = true;
            clean &= WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0;
          } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
        }
      }
      StopChildren(children, 5.0);  // whoever did not stop in time
      if (!(sig == SIGTERM && clean)) result = Aborted("job stopped by signal {} ({})", sig, strsignal(sig));
      break;
    }
    int status = 0;
    pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid < 0 && errno != EINTR && errno != ECHILD) return ErrnoError("waitpid", errno);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    for (auto& c : children) {
      if (c.pid != pid) continue;
      c.done = true;
      c.status = status;
      --remaining;
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        // A rank that died makes its peers fail within milliseconds: give them a moment to be
        // reaped too, then name the rank that died by a signal (the cause) before the others.
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        for (auto& o : children) {
          if (!o.done && waitpid(o.pid, &o.status, WNOHANG) == o.pid) o.done = true;
        }
        const Child* cause = &c;
        for (const auto& o : children) {
          if (o.done && WIFSIGNALED(o.status) && !WIFSIGNALED(cause->status)) cause = &o;
        }
        for (const auto& o : children) {
          if (o.done && !(WIFEXITED(o.status) && WEXITSTATUS(o.status) == 0)) {
            LogError("rank {} (pid {}) failed: {}", o.rank, o.pid, DescribeExit(o.status));
          }
        }
        LogError("stopping the other ranks");
        StopChildren(children, 10.0);
        result = Aborted("rank {} failed ({}); see {}/logs/rank-{}.log", cause->rank, DescribeExit(cause->status),
                         run_dir, cause->rank);
        remaining = 0;
      }
    }
  }
  if (redis) MS_RETURN_IF_ERROR(redis->Stop());
  return result;
}

}  // namespace

Status RunJob(const config::JobSpec& spec, const TrainOptions& options) {
  if (config::WorldSize(spec.parallel) == 1) {
    auto rt = SingleRankRuntime();
    return Train(spec, options, *rt).status();
  }
  if (GetEnv("SLURM_JOB_ID")) {
    LogWarn("inside a Slurm allocation: launching ranks locally (srun launch is not built yet)");
  }
  return RunLocalRanks(spec, options);
}

Status RunWorker(const std::string& job_spec_path, const TrainOptions& options) {
  MS_ASSIGN_OR_RETURN(config::JobSpec spec, config::LoadJobSpec(job_spec_path));
  MS_RETURN_IF_ERROR(config::ResolveAndValidate(&spec));
  const int world = config::WorldSize(spec.parallel);
  MS_ASSIGN_OR_RETURN(bootstrap::RankInfo me, bootstrap::RankInfoFromEnv(-1));
  if (me.rank < 0 || me.rank >= world) {
    return InvalidArgument("worker rank {} (MEGASCALE_RANK) outside the job's world of {}", me.rank, world);
  }
  SetLogRank(me.rank);
  auto url = GetEnv("MEGASCALE_STORE_URL");
  auto job_id = GetEnv("MEGASCALE_JOB_ID");
  if (!url || !job_id)
    return InvalidArgument("worker needs MEGASCALE_STORE_URL and MEGASCALE_JOB_ID (set by the driver)");
  bootstrap::StoreOptions so;
  so.url = *url;
  so.job_id = *job_id;
  MS_ASSIGN_OR_RETURN(auto store, bootstrap::ConnectRedisStore(so));
  MS_ASSIGN_OR_RETURN(auto grid, bootstrap::ParallelGrid::Make(world, spec.parallel.tp, spec.parallel.pp));
  const bootstrap::Millis timeout(120000);
  MS_ASSIGN_OR_RETURN(auto topo, bootstrap::Rendezvous(*store, me, world, grid, timeout));
  bootstrap::ProcessGroupOptions po;
  po.timeout = timeout;
  po.listen_address = me.address;
  MS_ASSIGN_OR_RETURN(auto groups, bootstrap::CreateProcessGroups(*store, topo, po));
  auto holder = std::make_shared<std::pair<bootstrap::ProcessGroups, std::unique_ptr<bootstrap::Store>>>(
      std::move(groups), std::move(store));
  auto& g = holder->first;
  const auto coords = grid.CoordsOf(me.rank);
  Runtime rt;
  rt.rank = me.rank;
  rt.world = world;
  rt.local_world = topo.local_world;
  rt.tp_rank = coords.tp;
  rt.pp_rank = coords.pp;
  rt.dp_rank = coords.dp;
  auto make = [&](const std::shared_ptr<gloo::Context>& ctx, std::string name) {
    comm::GlooOptions go;
    go.name = std::move(name);
    go.timeout = std::chrono::milliseconds(60000);
    return comm::MakeGlooCommunicator(ctx, go);
  };
  rt.tp = make(g.tp, fmt::format("tp[{}]", grid.GroupIndex(bootstrap::GroupKind::kTp, me.rank)));
  rt.pp = make(g.pp, fmt::format("pp[{}]", grid.GroupIndex(bootstrap::GroupKind::kPp, me.rank)));
  rt.dp = make(g.dp, fmt::format("dp[{}]", grid.GroupIndex(bootstrap::GroupKind::kDp, me.rank)));
  rt.world_comm = make(g.world, "world");
  if (spec.parallel.pp > 1 && spec.model.tied_embeddings && g.embedding) {
    rt.embedding =
        make(g.embedding, fmt::format("embedding[{}]", grid.GroupIndex(bootstrap::GroupKind::kEmbedding, me.rank)));
  }
#if defined(MS_HAVE_NCCL)
  // NCCL groups for the CUDA backend on GPUs: the same members and group ranks as the Gloo groups, each created
  // from an id its leader publishes in the store, in the Gloo groups' order (no rank waits on a group it is not
  // in). Not run in CI (no GPU).
  rt.use_nccl = [holder, grid, timeout, rank = me.rank](Runtime& r, void* stream) -> Status {
    const auto& groups = holder->first;
    auto make = [&](bootstrap::GroupKind kind) -> Result<std::unique_ptr<comm::Communicator>> {
      const auto& members = groups.members[static_cast<int>(kind)];
      auto pos = std::find(members.begin(), members.end(), rank);
      if (pos == members.end())
        return Internal("rank {} is not in its own {} group", rank, bootstrap::GroupKindName(kind));
      const int index = grid.GroupIndex(kind, rank);
      comm::NcclOptions o;
      o.name = fmt::format("nccl-{}[{}]", bootstrap::GroupKindName(kind), index);
      o.compute_stream = static_cast<cudaStream_t>(stream);
      return bootstrap::CreateNcclCommunicator(
          *holder->second, fmt::format("nccl/{}/{}", bootstrap::GroupKindName(kind), index),
          static_cast<int>(pos - members.begin()), static_cast<int>(members.size()), timeout, o);
    };
    MS_ASSIGN_OR_RETURN(r.tp, make(bootstrap::GroupKind::kTp));
    MS_ASSIGN_OR_RETURN(r.pp, make(bootstrap::GroupKind::kPp));
    MS_ASSIGN_OR_RETURN(r.dp, make(bootstrap::GroupKind::kDp));
    if (r.embedding) {
      MS_ASSIGN_OR_RETURN(r.embedding, make(bootstrap::GroupKind::kEmbedding));
    }
    return Status::Ok();
  };
#endif
  MS_ASSIGN_OR_RETURN(auto ckpt_store, holder->second->Clone());
  rt.coordinator = MakeStoreCoordinator(std::move(ckpt_store));
  rt.keepalive = holder;
  return Train(spec, options, rt).status();
}

}  // namespace ms::runner
