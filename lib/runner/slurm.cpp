// The driver's decisions about a Slurm allocation: does the job fit, where does the store listen,
// what does parallel.dp: auto mean.
#include <numeric>

#include "cuda/cuda.h"
#include "runner/driver.h"
#include "runner/runner.h"

namespace ms::runner {
namespace {

std::string Divisors(int n) {
  std::string out;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) out += fmt::format("{}{}", out.empty() ? "" : ", ", d);
  }
  return out;
}

}  // namespace

Result<SlurmFit> FitSlurmAllocation(const config::JobSpec& spec, const cluster::SlurmAllocation& a) {
  const auto& p = spec.parallel;
  const int world = static_cast<int>(config::WorldSize(p));
  const int nodes = static_cast<int>(a.nodes.size());
  const int per_node = a.uniform_tasks_per_node();
  const std::string layout = fmt::format("tp*pp*dp = {}*{}*{} = {} ranks", p.tp, p.pp, p.dp, world);
  const std::string have =
      fmt::format("Slurm job {} has {} tasks on {} node{}", a.job_id, a.tasks, nodes, nodes == 1 ? "" : "s");
  if (per_node == 0) {
    std::string counts;
    for (int t : a.tasks_per_node) counts += fmt::format("{}{}", counts.empty() ? "" : ",", t);
    return FailedPrecondition(
        "{} with different numbers of tasks per node ({}); megascale places the same number of ranks on every "
        "node: submit with --ntasks-per-node",
        have, counts);
  }
  // More tasks than ranks is fine when whole nodes are left over: spare nodes, which the fault
  // tolerance uses in place of a bad one.
  const bool spare_nodes = world < a.tasks && world % per_node == 0;
  if (world != a.tasks && !spare_nodes) {
    std::string fix;
    if (world % per_node == 0) {
      fix = fmt::format("submit with --nodes={} --ntasks-per-node={}", world / per_node, per_node);
    } else {
      fix = fmt::format("submit with --ntasks={} and a --ntasks-per-node that divides it", world);
    }
    const int group = p.tp * p.pp;
    if (a.tasks % group == 0) {
      fix += fmt::format(", or set parallel.dp: {} (or parallel.dp: auto) to use this allocation", a.tasks / group);
    }
    return FailedPrecondition("the job spec needs {}, but {} ({} per node): {}", layout, have, per_node, fix);
  }
  if (per_node % p.tp != 0) {
    return FailedPrecondition(
        "parallel.tp = {} does not divide the {} tasks per node of Slurm job {}: a tensor-parallel group would "
        "straddle two nodes (its collectives, on every layer, would cross the network); submit with "
        "--ntasks-per-node={} (a multiple of tp), or use tp in {{{}}}",
        p.tp, per_node, a.job_id, (per_node + p.tp - 1) / p.tp * p.tp, Divisors(per_node));
  }
  const bool gpus = spec.runtime.backend != config::Backend::kCpu && cuda::LinkedFlavor() == cuda::Flavor::kGpu;
  if (gpus && a.gpus_per_node >= 0 && per_node > a.gpus_per_node) {
    return FailedPrecondition(
        "{} ranks per node but Slurm job {} has {} GPU{} per node (one rank drives one GPU): submit with "
        "--ntasks-per-node={} or --gpus-per-node={}",
        per_node, a.job_id, a.gpus_per_node, a.gpus_per_node == 1 ? "" : "s", a.gpus_per_node, per_node);
  }
  return SlurmFit{world / per_node, per_node};
}

Result<std::string> ChooseStoreAddress(const config::JobSpec& spec, const cluster::SlurmAllocation* alloc) {
  if (!spec.runtime.address.empty()) return spec.runtime.address;
  if (!spec.runtime.interface.empty()) {
    auto a = cluster::InterfaceAddress(spec.runtime.interface);
    if (!a.ok()) return a.status().WithContext(config::KeyLocation(spec, "runtime.interface"));
    return a;
  }
  if (alloc) {
    auto a = cluster::AddressTowardNodes(alloc->nodes);
    if (!a.ok()) {
      return a.status().WithContext(
          "choosing the address of the embedded redis-server that the allocation's nodes must reach (set "
          "runtime.address or runtime.interface)");
    }
    return a;
  }
  return std::string("127.0.0.1");  // every rank on this host
}

Status ResolveForLauncher(config::JobSpec* spec) {
  if (spec->parallel.dp != 0) return Status::Ok();
  MS_ASSIGN_OR_RETURN(auto alloc, cluster::ReadSlurmAllocation());
  if (!alloc) return Status::Ok();  // ResolveAndValidate says what auto needs
  return config::ResolveAutoDataParallel(
      spec, alloc->tasks, fmt::format("the Slurm allocation (job {}, {} tasks)", alloc->job_id, alloc->tasks));
}

}  // namespace ms::runner
