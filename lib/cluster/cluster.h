// megascale cluster: where ranks run. One notion of HOST for the rest of the code (the node a
// rank runs on, the ranks on it, the rank's position there), the Slurm allocation a job may run
// in (its variables and node lists, parsed and checked), and the addresses a job listens on.
// defines: Host, ExpandHostList, ExpandCounts, SlurmAllocation, ReadSlurmAllocation,
//          CpusPerRank, ResolveHost, LocalAddressToward, InterfaceAddress
//
// Thread safety: pure functions and plain values. Errors: InvalidArgument for malformed input
// (naming the variable and its value), NotFound / Unavailable for names and routes that do not
// resolve (naming them, with the key that overrides the choice).
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"

namespace ms::cluster {

// The host a rank runs on, as every module that cares sees it (the GPU a rank drives is its
// local rank; threads per rank come from the host's CPUs; one data loader per host; a bad host
// is excluded as a whole).
struct Host {
  int index = 0;           // node id: 0 .. num_hosts - 1 (hosts sorted by name; SLURM_NODEID under Slurm)
  std::string name;        // its hostname
  int num_hosts = 1;       // hosts in the job
  int local_rank = 0;      // this rank's position among the ranks of its host
  int local_world = 1;     // ranks on this host
  std::vector<int> ranks;  // global ranks on this host, ascending
  int cpus_per_rank = 1;   // compute threads a rank may use (see CpusPerRank)
};

// ---- Slurm ------------------------------------------------------------------------------

// Expands a Slurm host list: "node[01-04,7],gpu-a[1-2]" -> node01 node02 node03 node04 node7
// gpu-a1 gpu-a2 (zero padding kept; several bracket groups and plain names; "a[1-2]b" suffixes).
Result<std::vector<std::string>> ExpandHostList(std::string_view list);
// Expands Slurm's per-node counts: "4(x2),3" -> 4 4 3 (SLURM_TASKS_PER_NODE, SLURM_JOB_CPUS_PER_NODE).
Result<std::vector<int>> ExpandCounts(std::string_view counts);

using EnvLookup = std::function<std::optional<std::string>(const char* name)>;

// The allocation a process runs in, from Slurm's variables.
struct SlurmAllocation {
  std::string job_id;               // SLURM_JOB_ID
  std::vector<std::string> nodes;   // SLURM_JOB_NODELIST, expanded
  std::vector<int> tasks_per_node;  // SLURM_TASKS_PER_NODE, expanded (one entry per node)
  int tasks = 0;                    // SLURM_NTASKS, else the sum of tasks_per_node
  int cpus_per_task = 0;            // SLURM_CPUS_PER_TASK; 0 when not given
  std::vector<int> cpus_per_node;   // SLURM_JOB_CPUS_PER_NODE, expanded; may be empty
  int gpus_per_node = -1;           // SLURM_GPUS_ON_NODE / SLURM_GPUS_PER_NODE ("gpu:a100:8" -> 8); -1 unknown
  std::string step_id;              // SLURM_STEP_ID, when set
  // True when this process is a task of an srun job step; false in the batch script, the salloc
  // shell, and Slurm's special batch / extern / interactive steps (ids 4294967290 and above).
  bool in_task_step() const;
  // The same number of tasks on every node (0 when they differ).
  int uniform_tasks_per_node() const;
};

// nullopt outside Slurm (no SLURM_JOB_ID). InvalidArgument naming the variable for a malformed
// value, or when the node list and the task counts disagree.
Result<std::optional<SlurmAllocation>> ReadSlurmAllocation(const EnvLookup& env = GetEnv);

// Compute threads for one of `local_world` ranks on this host: SLURM_CPUS_PER_TASK inside a Slurm
// step that sets it, else the CPUs this process may run on (its affinity mask) divided by the
// ranks of the host; at least 1.
int CpusPerRank(int local_world, const EnvLookup& env = GetEnv);

// ---- addresses ----------------------------------------------------------------------------

// IPv4 address of a host name (or a literal address). NotFound naming it when it does not resolve.
Result<std::string> ResolveHost(const std::string& name);
// The address of this host on the interface that routes to `peer` (a host name or IPv4 address):
// the source address the kernel picks for it (no packet is sent). 127.0.0.1 for a local peer.
Result<std::string> LocalAddressToward(const std::string& peer);
// The IPv4 address of a network interface of this host ("eth0", "ib0"). NotFound listing the
// interfaces that have one.
Result<std::string> InterfaceAddress(const std::string& interface);
// This host's address toward the other hosts of `nodes` (LocalAddressToward the first of them that
// is not this host and resolves), or 127.0.0.1 when every node is this host. For a server that the
// ranks on those nodes must reach.
Result<std::string> AddressTowardNodes(const std::vector<std::string>& nodes);
// True for an IPv4 address in 127.0.0.0/8.
bool IsLoopback(const std::string& address);

}  // namespace ms::cluster
