// ReadSlurmAllocation, CpusPerRank.
#include <sched.h>

#include <charconv>
#include <numeric>

#include "cluster/cluster.h"

namespace ms::cluster {
namespace {

Result<int> IntVar(const EnvLookup& env, const char* name, int fallback) {
  auto v = env(name);
  if (!v || v->empty()) return fallback;
  int out = 0;
  auto [p, ec] = std::from_chars(v->data(), v->data() + v->size(), out);
  if (ec != std::errc() || p != v->data() + v->size() || out < 0) {
    return InvalidArgument("Slurm variable {}='{}' is not a non-negative integer", name, *v);
  }
  return out;
}

// "8", "gpu:8", "gpu:a100:8", "a100:8" -> 8; -1 when not a count.
int GpuCount(std::string_view s) {
  const size_t colon = s.rfind(':');
  if (colon != std::string_view::npos) s = s.substr(colon + 1);
  int n = -1;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
  return ec == std::errc() && p == s.data() + s.size() ? n : -1;
}

}  // namespace

int SlurmAllocation::uniform_tasks_per_node() const {
  if (tasks_per_node.empty()) return 0;
  for (int t : tasks_per_node) {
    if (t != tasks_per_node[0]) return 0;
  }
  return tasks_per_node[0];
}

bool SlurmAllocation::in_task_step() const {
  if (step_id.empty()) return false;
  unsigned long long id = 0;
  auto [p, ec] = std::from_chars(step_id.data(), step_id.data() + step_id.size(), id);
  if (ec != std::errc() || p != step_id.data() + step_id.size()) return false;  // "batch", "extern", ...
  return id < 4294967290ULL;  // SLURM_INTERACTIVE_STEP, SLURM_BATCH_SCRIPT, SLURM_EXTERN_CONT and up
}

Result<std::optional<SlurmAllocation>> ReadSlurmAllocation(const EnvLookup& env) {
  auto job = env("SLURM_JOB_ID");
  if (!job || job->empty()) return std::optional<SlurmAllocation>();
  SlurmAllocation a;
  a.job_id = *job;
  auto nodelist = env("SLURM_JOB_NODELIST");
  if (!nodelist) nodelist = env("SLURM_NODELIST");
  if (!nodelist || nodelist->empty()) {
    return InvalidArgument("inside Slurm job {} but SLURM_JOB_NODELIST is not set", a.job_id);
  }
  auto nodes = ExpandHostList(*nodelist);
  if (!nodes.ok()) return nodes.status().WithContext("SLURM_JOB_NODELIST");
  a.nodes = std::move(nodes).value();
  if (auto tpn = env("SLURM_TASKS_PER_NODE"); tpn && !tpn->empty()) {
    auto counts = ExpandCounts(*tpn);
    if (!counts.ok()) return counts.status().WithContext("SLURM_TASKS_PER_NODE");
    a.tasks_per_node = std::move(counts).value();
    if (a.tasks_per_node.size() != a.nodes.size()) {
      return InvalidArgument("SLURM_TASKS_PER_NODE='{}' gives {} counts for the {} nodes of SLURM_JOB_NODELIST='{}'",
                             *tpn, a.tasks_per_node.size(), a.nodes.size(), *nodelist);
    }
  } else {
    a.tasks_per_node.assign(a.nodes.size(), 1);  // Slurm's default: one task per node
  }
  const int sum = std::accumulate(a.tasks_per_node.begin(), a.tasks_per_node.end(), 0);
  MS_ASSIGN_OR_RETURN(a.tasks, IntVar(env, "SLURM_NTASKS", sum));
  MS_ASSIGN_OR_RETURN(a.cpus_per_task, IntVar(env, "SLURM_CPUS_PER_TASK", 0));
  if (auto cpn = env("SLURM_JOB_CPUS_PER_NODE"); cpn && !cpn->empty()) {
    auto counts = ExpandCounts(*cpn);
    if (!counts.ok()) return counts.status().WithContext("SLURM_JOB_CPUS_PER_NODE");
    a.cpus_per_node = std::move(counts).value();
  }
  for (const char* name : {"SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"}) {
    if (auto g = env(name); g && !g->empty()) {
      a.gpus_per_node = GpuCount(*g);
      if (a.gpus_per_node < 0) return InvalidArgument("Slurm variable {}='{}' is not a GPU count", name, *g);
      break;
    }
  }
  if (auto step = env("SLURM_STEP_ID"); step && !step->empty()) a.step_id = *step;
  return std::optional<SlurmAllocation>(std::move(a));
}

int CpusPerRank(int local_world, const EnvLookup& env) {
  if (auto c = env("SLURM_CPUS_PER_TASK"); c && env("SLURM_STEP_ID")) {
    int n = 0;
    auto [p, ec] = std::from_chars(c->data(), c->data() + c->size(), n);
    if (ec == std::errc() && p == c->data() + c->size() && n > 0) return n;
  }
  int cpus = NumCores();
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) cpus = std::max(1, CPU_COUNT(&set));
  return std::max(1, cpus / std::max(1, local_world));
}

}  // namespace ms::cluster
