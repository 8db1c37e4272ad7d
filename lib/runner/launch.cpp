// The driver's launch path, shared by training attempts and the self-check: the job's store and
// one attempt of ranks, local or as a Slurm job step (driver.h).
#include <limits.h>
#include <stdlib.h>

#include <cerrno>

#include <fmt/ranges.h>

#include "runner/driver.h"

namespace ms::runner {

Result<JobStore> StartJobStore(const config::JobSpec& spec, const cluster::SlurmAllocation* alloc, int world) {
  JobStore out;
  out.url = spec.runtime.redis;
  if (!spec.runtime.redis_password_file.empty()) {
    MS_ASSIGN_OR_RETURN(out.password, ReadFile(spec.runtime.redis_password_file));
    while (!out.password.empty() && (out.password.back() == '\n' || out.password.back() == '\r')) {
      out.password.pop_back();
    }
  }
  if (out.url.empty()) {
    bootstrap::EmbeddedRedisOptions ro;
    ro.max_clients = std::max(1000, 4 * world);
    // Its pid file and log live (and, after a crash, stay) in the run directory; redis-server
    // changes into its directory, so the path must be absolute.
    char abs_dir[PATH_MAX];
    if (realpath(spec.log.run_dir.c_str(), abs_dir) == nullptr) {
      return ErrnoError(fmt::format("resolving {}", spec.log.run_dir), errno);
    }
    ro.temp_parent = abs_dir;
    MS_ASSIGN_OR_RETURN(ro.bind_address, ChooseStoreAddress(spec, alloc));
    MS_ASSIGN_OR_RETURN(auto r, bootstrap::EmbeddedRedis::Start(ro));
    out.redis.emplace(std::move(r));
    out.url = out.redis->url();
    out.password = out.redis->password();
    LogInfo("started redis-server (pid {}) on {}:{} for the rank bootstrap", out.redis->pid(), out.redis->address(),
            out.redis->port());
  } else if (out.password.empty()) {
    out.password = GetEnv("MEGASCALE_REDIS_PASSWORD").value_or("");
  }
  return out;
}

std::vector<std::string> RankEnvironment(int world, const JobStore& store, const std::string& job_id, int attempt) {
  std::vector<std::string> env = {
      fmt::format("MEGASCALE_WORLD={}", world), fmt::format("MEGASCALE_STORE_URL={}", store.url),
      fmt::format("MEGASCALE_JOB_ID={}", job_id), fmt::format("MEGASCALE_ATTEMPT={}", attempt)};
  if (!store.password.empty()) env.push_back("MEGASCALE_REDIS_PASSWORD=" + store.password);
  return env;
}

Result<std::unique_ptr<Attempt>> LaunchAttempt(LaunchPlan plan, const Placement& where, const std::string& step_name,
                                               const std::string& what) {
  if (where.alloc) {
    SlurmStep step;
    step.job_id = where.alloc->job_id;
    step.nodes = where.fit.nodes;
    step.tasks_per_node = where.fit.tasks_per_node;
    step.exclude = where.exclude;
    step.name = step_name;
    LogInfo("{}: launching {} ranks as a Slurm job step of job {}: {} node{} x {} tasks{}", what, plan.world,
            where.alloc->job_id, step.nodes, step.nodes == 1 ? "" : "s", step.tasks_per_node,
            step.exclude.empty() ? "" : fmt::format(" (excluding {})", fmt::join(step.exclude, ",")));
    return LaunchSlurmStep(plan, step);
  }
  plan.env.push_back(fmt::format("MEGASCALE_LOCAL_WORLD={}", plan.world));
  plan.env.push_back(fmt::format("OMP_NUM_THREADS={}", where.threads));
  plan.rank_env = [](int r) {
    return std::vector<std::string>{fmt::format("MEGASCALE_RANK={}", r), fmt::format("MEGASCALE_LOCAL_RANK={}", r)};
  };
  LogInfo("{}: launching {} local ranks ({} thread{} each)", what, plan.world, where.threads,
          where.threads == 1 ? "" : "s");
  return LaunchLocal(plan);
}

}  // namespace ms::runner
