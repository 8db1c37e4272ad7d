// RunWorker: one rank of a multi-rank job, started by the driver (attempt.h): JoinJob (store,
// rendezvous, process groups), then Train().
#include <algorithm>
#include <array>
#include <cstdlib>

#include "bootstrap/bootstrap.h"
#include "cuda/cuda.h"
#include "runner/checkpointing.h"
#include "runner/heartbeat.h"
#include "runner/rank.h"
#include "runner/runner.h"

namespace ms::runner {

// The driver's milestones, "name=seconds,..." in MEGASCALE_STARTUP.
std::vector<std::pair<std::string, double>> DriverMilestones() {
  std::vector<std::pair<std::string, double>> out;
  const std::string text = GetEnv("MEGASCALE_STARTUP").value_or("");
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(start, end - start);
    const size_t eq = item.find('=');
    if (eq != std::string::npos) out.emplace_back(item.substr(0, eq), std::strtod(item.c_str() + eq + 1, nullptr));
    start = end + 1;
  }
  return out;
}

Result<std::unique_ptr<Runtime>> JoinJob(const config::JobSpec& spec, double worker_start) {
  const int world = static_cast<int>(config::WorldSize(spec.parallel));
  MS_ASSIGN_OR_RETURN(bootstrap::RankInfo me, bootstrap::RankInfoFromEnv(-1));
  auto url = GetEnv("MEGASCALE_STORE_URL");
  auto job_id = GetEnv("MEGASCALE_JOB_ID");
  if (!url || !job_id)
    return InvalidArgument("worker needs MEGASCALE_STORE_URL and MEGASCALE_JOB_ID (set by the driver)");
  // The address this rank's communicators listen on: this host's address on runtime.interface, or
  // on the interface that routes to the store (the driver's host); loopback for a one-host job.
  if (!GetEnv("MEGASCALE_LISTEN_ADDRESS")) {
    MS_ASSIGN_OR_RETURN(bootstrap::RedisEndpoint store_ep, bootstrap::ParseRedisUrl(*url));
    auto address = spec.runtime.interface.empty() ? cluster::LocalAddressToward(store_ep.host)
                                                  : cluster::InterfaceAddress(spec.runtime.interface);
    if (!address.ok()) return address.status().WithContext("choosing the address of this rank's communicators");
    me.address = *address;
  }
  if (me.rank < 0 || me.rank >= world) {
    return InvalidArgument("worker rank {} (MEGASCALE_RANK) outside the job's world of {}", me.rank, world);
  }
  SetLogRank(me.rank);
  bootstrap::StoreOptions so;
  so.url = *url;  // the password comes from MEGASCALE_REDIS_PASSWORD
  so.job_id = *job_id;
  if (auto attempt = GetEnv("MEGASCALE_ATTEMPT")) so.attempt = std::atoi(attempt->c_str());  // its own keys
  MS_ASSIGN_OR_RETURN(auto store, bootstrap::ConnectRedisStore(so));
  MS_ASSIGN_OR_RETURN(auto grid, bootstrap::ParallelGrid::Make(world, spec.parallel.tp, spec.parallel.pp));
  const bootstrap::Millis timeout(static_cast<int64_t>(spec.runtime.rendezvous_timeout_s * 1000));
  MS_ASSIGN_OR_RETURN(auto topo, bootstrap::Rendezvous(*store, me, world, grid, timeout));
  bootstrap::ProcessGroupOptions po;
  po.timeout = timeout;
  po.listen_address = me.address;
  MS_ASSIGN_OR_RETURN(auto groups, bootstrap::CreateProcessGroups(*store, topo, po));
  const double bootstrap_done = WallSeconds();
  const bool batched = groups.loop_note.rfind("SCHED_BATCH", 0) == 0;
  const bool asked = groups.loop_note.find("MEGASCALE_GLOO_LOOP=normal") != std::string::npos;
  if (!batched && !asked) {  // every rank: each may have failed in its own way
    LogWarn(
        "Gloo's event-loop thread {}: on a host with more busy threads than cores its spinning can cost several "
        "times the training's own CPU time (comm::MakeGlooTcpDevice)",
        groups.loop_note);
  } else if (me.rank == 0) {
    LogInfo("Gloo's event-loop thread: {}", groups.loop_note);
  }
  MS_ASSIGN_OR_RETURN(std::unique_ptr<bootstrap::Store> coordination_store, store->Clone());
  auto holder = std::make_shared<std::pair<bootstrap::ProcessGroups, std::unique_ptr<bootstrap::Store>>>(
      std::move(groups), std::move(store));
  auto& g = holder->first;
  const auto coords = grid.CoordsOf(me.rank);
  auto rt_owner = std::make_unique<Runtime>();
  Runtime& rt = *rt_owner;
  rt.rank = me.rank;
  rt.world = world;
  rt.host.index = topo.host_index;
  rt.host.name = me.hostname;
  rt.host.num_hosts = topo.num_hosts;
  rt.host.local_rank = topo.local_rank;
  rt.host.local_world = topo.local_world;
  rt.host.ranks = topo.host_ranks;
  rt.host.cpus_per_rank = cluster::CpusPerRank(topo.local_world);
  rt.tp_rank = coords.tp;
  rt.pp_rank = coords.pp;
  rt.dp_rank = coords.dp;
  rt.collective_timeout_s = spec.runtime.collective_timeout_s;
  rt.startup = DriverMilestones();
  rt.startup.emplace_back("worker_start", worker_start);
  rt.startup.emplace_back("bootstrap_done", bootstrap_done);
  // Every wait in a communicator is recorded on the board that the heartbeat publishes.
  auto board = std::make_shared<ProgressBoard>();
  board->set_pp_rank(coords.pp);
  std::array<int, 5> group_id{};  // by bootstrap::GroupKind
  auto make = [&](const std::shared_ptr<gloo::Context>& ctx, std::string name) {
    comm::GlooOptions go;
    go.name = name;
    go.timeout = std::chrono::milliseconds(static_cast<int64_t>(spec.runtime.collective_timeout_s * 1000));
    return TrackWaits(comm::MakeGlooCommunicator(ctx, go), board.get(), board->RegisterGroup(name));
  };
  rt.tp = make(g.tp, fmt::format("tp[{}]", grid.GroupIndex(bootstrap::GroupKind::kTp, me.rank)));
  group_id[static_cast<int>(bootstrap::GroupKind::kTp)] = 0;
  rt.pp = make(g.pp, fmt::format("pp[{}]", grid.GroupIndex(bootstrap::GroupKind::kPp, me.rank)));
  group_id[static_cast<int>(bootstrap::GroupKind::kPp)] = 1;
  rt.dp = make(g.dp, fmt::format("dp[{}]", grid.GroupIndex(bootstrap::GroupKind::kDp, me.rank)));
  group_id[static_cast<int>(bootstrap::GroupKind::kDp)] = 2;
  rt.world_comm = make(g.world, "world");
  if (spec.parallel.pp > 1 && spec.model.tied_embeddings && g.embedding) {
    rt.embedding =
        make(g.embedding, fmt::format("embedding[{}]", grid.GroupIndex(bootstrap::GroupKind::kEmbedding, me.rank)));
    group_id[static_cast<int>(bootstrap::GroupKind::kEmbedding)] = 4;
  }
  // NCCL groups for the CUDA backend (libnccl on GPUs, the emulated NCCL in megascale-emu): the same members and
  // group ranks as the Gloo groups, each created from an id its leader publishes in the store, in the Gloo groups'
  // order (no rank waits on a group it is not in).
  const auto watchdog = std::chrono::milliseconds(static_cast<int64_t>(spec.runtime.collective_timeout_s * 1000));
  rt.use_nccl = [holder, grid, timeout, watchdog, rank = me.rank, board, group_id](Runtime& r, void* stream,
                                                                                   device::Device* device) -> Status {
    const auto& groups = holder->first;
    auto make = [&](bootstrap::GroupKind kind) -> Result<std::unique_ptr<comm::Communicator>> {
      const auto& members = groups.members[static_cast<int>(kind)];
      auto pos = std::find(members.begin(), members.end(), rank);
      if (pos == members.end())
        return Internal("rank {} is not in its own {} group", rank, bootstrap::GroupKindName(kind));
      const int index = grid.GroupIndex(kind, rank);
      cuda::NcclOptions o;
      o.name = fmt::format("nccl-{}[{}]", bootstrap::GroupKindName(kind), index);
      o.compute_stream = stream;
      o.timeout = watchdog;
      o.device = device;
      const int me_in_group = static_cast<int>(pos - members.begin()), n = static_cast<int>(members.size());
      MS_ASSIGN_OR_RETURN(
          std::string id,
          bootstrap::ShareGroupId(*holder->second, fmt::format("nccl/{}/{}", bootstrap::GroupKindName(kind), index),
                                  me_in_group, n, timeout, [] { return cuda::NewNcclUniqueId(); }));
      MS_ASSIGN_OR_RETURN(auto c, cuda::MakeNcclCommunicator(id, me_in_group, n, o));
      return TrackWaits(std::move(c), board.get(), group_id[static_cast<int>(kind)]);
    };
    MS_ASSIGN_OR_RETURN(r.tp, make(bootstrap::GroupKind::kTp));
    MS_ASSIGN_OR_RETURN(r.pp, make(bootstrap::GroupKind::kPp));
    MS_ASSIGN_OR_RETURN(r.dp, make(bootstrap::GroupKind::kDp));
    if (r.embedding) {
      MS_ASSIGN_OR_RETURN(r.embedding, make(bootstrap::GroupKind::kEmbedding));
    }
    return Status::Ok();
  };
  MS_ASSIGN_OR_RETURN(rt.coordinator, MakeStoreCoordinator(*coordination_store));
  rt.store = std::move(coordination_store);
  rt.keepalive = holder;
  rt.board = board;
  return rt_owner;
}

Result<JobEnd> RunWorker(const std::string& job_spec_path, const TrainOptions& options) {
  InstallStopSignals();  // before anything slow: a signal during start-up is honoured after it
  const double worker_start = WallSeconds();
  MS_ASSIGN_OR_RETURN(config::JobSpec spec, config::LoadJobSpec(job_spec_path));
  MS_RETURN_IF_ERROR(config::ResolveAndValidate(&spec));
  MS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, JoinJob(spec, worker_start));
  // The heartbeat: from here to the end, whatever the training thread does (destroyed before rt).
  std::unique_ptr<Heartbeat> heartbeat;
  if (spec.fault.heartbeat_s > 0) {
    MS_ASSIGN_OR_RETURN(auto beat_store, rt->store->Clone());
    heartbeat =
        Heartbeat::Start(std::move(beat_store), rt->rank, rt->host.name, spec.fault.heartbeat_s, rt->board.get());
  }
  auto summary = Train(spec, options, *rt);
  if (!summary.ok()) {
    // Told to the driver, which names it when it reports this rank's failure (best effort).
    rt->store->Set(fmt::format("error/{}", rt->rank), summary.status().message()).IgnoreError();
    return summary.status();
  }
  return summary->end;
}

}  // namespace ms::runner
