// Slurm host lists, per-node counts, allocation variables, and address selection.
#include <doctest/doctest.h>

#include <map>

#include "cluster/cluster.h"

namespace ms::cluster {
namespace {

using Strings = std::vector<std::string>;

EnvLookup Env(std::map<std::string, std::string> vars) {
  return [vars](const char* name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace

TEST_CASE("host lists: ranges, padding, several groups and names") {
  CHECK(*ExpandHostList("node0") == Strings{"node0"});
  CHECK(*ExpandHostList("node[0-3]") == Strings{"node0", "node1", "node2", "node3"});
  CHECK(*ExpandHostList("node[01-04,7],gpu-a[1-2]") ==
        Strings{"node01", "node02", "node03", "node04", "node7", "gpu-a1", "gpu-a2"});
  CHECK(*ExpandHostList("n[008-011]") == Strings{"n008", "n009", "n010", "n011"});
  CHECK(*ExpandHostList("a,b,c[9-10]") == Strings{"a", "b", "c9", "c10"});
  CHECK(*ExpandHostList("rack[1-2]-n[1-2]") == Strings{"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"});
  CHECK(*ExpandHostList("x[3]y") == Strings{"x3y"});
  for (const char* bad : {"node[1-", "node[2-1]", "node[a-b]", "node]1[", "a,,b", "n[[1]]", ""}) {
    auto r = ExpandHostList(bad);
    CHECK_MESSAGE(!r.ok(), bad);
    if (!r.ok()) CHECK(r.status().code() == Code::kInvalidArgument);
  }
}

TEST_CASE("per-node counts") {
  CHECK(*ExpandCounts("4") == std::vector<int>{4});
  CHECK(*ExpandCounts("4(x2),3") == std::vector<int>{4, 4, 3});
  CHECK(*ExpandCounts("2(x3)") == std::vector<int>{2, 2, 2});
  for (const char* bad : {"4(x2", "x", "4(xa)", "-1", ""}) CHECK_MESSAGE(!ExpandCounts(bad).ok(), bad);
}

TEST_CASE("the allocation from Slurm's variables") {
  CHECK_FALSE(ReadSlurmAllocation(Env({}))->has_value());  // outside Slurm
  auto a = ReadSlurmAllocation(Env({{"SLURM_JOB_ID", "77"},
                                    {"SLURM_JOB_NODELIST", "node[0-1]"},
                                    {"SLURM_TASKS_PER_NODE", "4(x2)"},
                                    {"SLURM_NTASKS", "8"},
                                    {"SLURM_CPUS_PER_TASK", "2"},
                                    {"SLURM_JOB_CPUS_PER_NODE", "8(x2)"},
                                    {"SLURM_GPUS_ON_NODE", "8"}}));
  REQUIRE(a.ok());
  REQUIRE(a->has_value());
  const SlurmAllocation& s = **a;
  CHECK(s.job_id == "77");
  CHECK(s.nodes == Strings{"node0", "node1"});
  CHECK(s.tasks == 8);
  CHECK(s.uniform_tasks_per_node() == 4);
  CHECK(s.cpus_per_task == 2);
  CHECK(s.cpus_per_node == std::vector<int>{8, 8});
  CHECK(s.gpus_per_node == 8);
  CHECK(s.step_id.empty());
  // salloc -N3 without -n: one task per node; GPUs as gres text; inside a step.
  auto b = ReadSlurmAllocation(Env({{"SLURM_JOB_ID", "78"},
                                    {"SLURM_NODELIST", "gpu[1-3]"},
                                    {"SLURM_GPUS_PER_NODE", "gpu:a100:4"},
                                    {"SLURM_STEP_ID", "0"}}));
  REQUIRE(b.ok());
  CHECK((*b)->tasks == 3);
  CHECK((*b)->uniform_tasks_per_node() == 1);
  CHECK((*b)->gpus_per_node == 4);
  CHECK((*b)->step_id == "0");
  CHECK((*b)->in_task_step());
  CHECK_FALSE(s.in_task_step());  // no SLURM_STEP_ID: the batch script or the salloc shell
  SlurmAllocation special = s;
  for (const char* id : {"4294967290", "4294967291", "4294967292", "batch", "interactive"}) {
    special.step_id = id;
    CHECK_MESSAGE(!special.in_task_step(), id);  // batch script, extern and interactive steps
  }
  // Uneven tasks per node: not uniform.
  auto c = ReadSlurmAllocation(
      Env({{"SLURM_JOB_ID", "79"}, {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_TASKS_PER_NODE", "4,2"}}));
  REQUIRE(c.ok());
  CHECK((*c)->tasks == 6);
  CHECK((*c)->uniform_tasks_per_node() == 0);
  // Malformed: named.
  auto d = ReadSlurmAllocation(
      Env({{"SLURM_JOB_ID", "80"}, {"SLURM_JOB_NODELIST", "n[1-2]"}, {"SLURM_TASKS_PER_NODE", "4(x3)"}}));
  REQUIRE_FALSE(d.ok());
  CHECK(d.status().message().find("SLURM_TASKS_PER_NODE") != std::string::npos);
  auto e = ReadSlurmAllocation(Env({{"SLURM_JOB_ID", "81"}, {"SLURM_JOB_NODELIST", "n1"}, {"SLURM_NTASKS", "x"}}));
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message().find("SLURM_NTASKS='x'") != std::string::npos);
  CHECK_FALSE(ReadSlurmAllocation(Env({{"SLURM_JOB_ID", "82"}})).ok());  // no node list
}

TEST_CASE("threads per rank: Slurm's CPUs per task inside a step, else the host's CPUs shared") {
  CHECK(CpusPerRank(1, Env({{"SLURM_CPUS_PER_TASK", "3"}, {"SLURM_STEP_ID", "0"}})) == 3);
  const int all = CpusPerRank(1, Env({}));
  CHECK(all >= 1);
  CHECK(CpusPerRank(1000, Env({})) == 1);
  CHECK(CpusPerRank(1, Env({{"SLURM_CPUS_PER_TASK", "3"}})) == all);  // the batch shell: not a step
}

TEST_CASE("addresses: names resolve, loopback stays loopback, interfaces are found or listed") {
  CHECK(*ResolveHost("127.0.0.1") == "127.0.0.1");
  CHECK(*ResolveHost("localhost") == "127.0.0.1");
  CHECK(*LocalAddressToward("localhost") == "127.0.0.1");
  CHECK(IsLoopback("127.0.0.5"));
  CHECK_FALSE(IsLoopback("10.1.2.3"));
  CHECK(*InterfaceAddress("lo") == "127.0.0.1");
  auto none = InterfaceAddress("no-such-if0");
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("lo (127.0.0.1)") != std::string::npos);
  auto bad = ResolveHost("no-such-host.invalid");
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().message().find("runtime.address") != std::string::npos);
}

}  // namespace ms::cluster
