// Rendezvous (registration, the one global barrier, topology) and the communicator-id exchange.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <map>
#include <set>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {
namespace {

bool ParseInt(std::string_view s, int* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

std::vector<std::string_view> Split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  size_t start = 0;
  while (true) {
    size_t end = s.find(sep, start);
    out.push_back(s.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start));
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return out;
}

// rank \t host \t local \t device \t pid \t address \t world \t grid
std::string EncodeRegistration(const RankInfo& me, int world, const ParallelGrid& grid) {
  return fmt::format("{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}", me.rank, me.hostname, me.local_rank, me.device, me.pid,
                     me.address, world, grid.ToString());
}

struct Registration {
  RankInfo info;
  int world = 0;
  std::string grid;
};

Result<Registration> DecodeRegistration(std::string_view blob) {
  auto f = Split(blob, '\t');
  Registration r;
  if (f.size() != 8 || !ParseInt(f[0], &r.info.rank) || !ParseInt(f[2], &r.info.local_rank) ||
      !ParseInt(f[3], &r.info.device) || !ParseInt(f[4], &r.info.pid) || !ParseInt(f[6], &r.world)) {
    return DataLoss("malformed registration '{}'", blob);
  }
  r.info.hostname = std::string(f[1]);
  r.info.address = std::string(f[5]);
  r.grid = std::string(f[7]);
  return r;
}

class PhaseClock {
 public:
  PhaseClock(Store& store, std::string name) : store_(store) {
    t_.name = std::move(name);
    t_.start = NowSeconds();
    s0_ = store.stats();
  }
  PhaseTiming Done() {
    StoreStats s = store_.stats();
    t_.end = NowSeconds();
    t_.ops = s.ops - s0_.ops;
    t_.bytes = s.bytes() - s0_.bytes();
    return t_;
  }

 private:
  Store& store_;
  PhaseTiming t_;
  StoreStats s0_;
};

// The builder's work: validate every registration and publish the per-host tables, then the host
// list, then topo/done (the barrier key). Returns the error to publish if the registrations are
// inconsistent; `hostnames` gets every host it could read, to publish the error to.
Status BuildTopology(Store& store, int world, const ParallelGrid& grid, std::set<std::string>* hostnames) {
  std::vector<std::string> keys;
  keys.reserve(world);
  for (int r = 0; r < world; ++r) keys.push_back(fmt::format("reg/{}", r));
  MS_ASSIGN_OR_RETURN(auto blobs, store.MultiGet(keys));
  std::map<std::string, std::vector<std::pair<int, int>>> by_host;  // host -> (rank, claimed local rank)
  const std::string want_grid = grid.ToString();
  std::vector<Registration> regs(world);
  for (int r = 0; r < world; ++r) {
    if (!blobs[r]) return Internal("rank {} is counted but its registration is missing", r);
    auto reg = DecodeRegistration(*blobs[r]);
    if (!reg.ok()) return reg.status().WithContext(fmt::format("registration of rank {}", r));
    regs[r] = std::move(reg).value();
    hostnames->insert(regs[r].info.hostname);
  }
  for (int r = 0; r < world; ++r) {
    const Registration& reg = regs[r];
    if (reg.world != world || reg.grid != want_grid) {
      return InvalidArgument(
          "rank {} (pid {} on {}) was started with {} ranks and layout {}, the others with {} and {}", r, reg.info.pid,
          reg.info.hostname, reg.world, reg.grid, world, want_grid);
    }
    by_host[reg.info.hostname].emplace_back(r, reg.info.local_rank);
  }
  int host_index = 0;
  for (auto& [host, ranks] : by_host) {
    const bool any_claimed = std::any_of(ranks.begin(), ranks.end(), [](auto& p) { return p.second >= 0; });
    std::vector<int> seen(ranks.size(), -1);
    std::string table;
    for (size_t i = 0; i < ranks.size(); ++i) {
      int local = ranks[i].second;
      if (!any_claimed) local = static_cast<int>(i);
      if (local < 0 || local >= static_cast<int>(ranks.size())) {
        return InvalidArgument("host {} has {} ranks but rank {} says its local rank is {}", host, ranks.size(),
                               ranks[i].first, local);
      }
      if (seen[local] >= 0) {
        return InvalidArgument("ranks {} and {} on host {} both say local rank {}", seen[local], ranks[i].first, host,
                               local);
      }
      seen[local] = ranks[i].first;
      table += fmt::format("{}{}:{}", i ? "," : "", ranks[i].first, local);
    }
    MS_RETURN_IF_ERROR(store.Set(fmt::format("topo/host/{}", host), fmt::format("{}\n{}", host_index, table)));
    ++host_index;
  }
  std::string hosts;
  for (auto& [host, ranks] : by_host) hosts += host + "\n";
  MS_RETURN_IF_ERROR(store.Set("topo/hosts", hosts));
  return store.Set("topo/done", std::to_string(by_host.size()));
}

}  // namespace

Result<RankInfo> RankInfoFromEnv(int fallback_rank) {
  RankInfo me;
  auto int_env = [](const char* name, int* out) -> Status {
    auto v = GetEnv(name);
    if (!v) return NotFound("{} not set", name);
    if (!ParseInt(*v, out)) return InvalidArgument("environment variable {}='{}' is not an integer", name, *v);
    return Status::Ok();
  };
  me.rank = fallback_rank;
  for (const char* name : {"MEGASCALE_RANK", "SLURM_PROCID"}) {
    Status s = int_env(name, &me.rank);
    if (s.ok()) break;
    if (s.code() != Code::kNotFound) return s;
  }
  for (const char* name : {"MEGASCALE_LOCAL_RANK", "SLURM_LOCALID"}) {
    Status s = int_env(name, &me.local_rank);
    if (s.ok()) break;
    if (s.code() != Code::kNotFound) return s;
  }
  me.hostname = HostName();
  me.pid = static_cast<int>(getpid());
  me.address = GetEnv("MEGASCALE_LISTEN_ADDRESS").value_or("127.0.0.1");
  return me;
}

Result<Topology> Rendezvous(Store& store, const RankInfo& me, int world, const ParallelGrid& grid, Millis timeout) {
  if (grid.world() != world) {
    return InvalidArgument("layout {} has {} ranks but the job has {}", grid.ToString(), grid.world(), world);
  }
  if (me.rank < 0 || me.rank >= world) return InvalidArgument("rank {} is outside 0..{}", me.rank, world - 1);
  if (me.hostname.empty() || me.hostname.find_first_of("\t\n,:") != std::string::npos) {
    return InvalidArgument("rank {}: bad hostname '{}'", me.rank, me.hostname);
  }
  Topology topo;
  topo.world = world;
  topo.rank = me.rank;
  topo.grid = grid;

  PhaseClock reg_clock(store, "register");
  const std::string key = fmt::format("reg/{}", me.rank);
  MS_ASSIGN_OR_RETURN(CasResult cas, store.CompareAndSet(key, std::nullopt, EncodeRegistration(me, world, grid)));
  if (!cas.swapped) {
    std::string who = "another process";
    if (cas.current) {
      auto other = DecodeRegistration(*cas.current);
      if (other.ok()) who = fmt::format("pid {} on {}", other->info.pid, other->info.hostname);
    }
    return InvalidArgument("rank {} registered twice in {}: already taken by {} (this is pid {} on {})", me.rank,
                           store.Describe(), who, me.pid, me.hostname);
  }
  MS_ASSIGN_OR_RETURN(int64_t arrived, store.Add("reg/count", 1));
  topo.phases.push_back(reg_clock.Done());

  PhaseClock topo_clock(store, "topology");
  if (arrived == world) {
    std::set<std::string> hostnames;
    Status built = BuildTopology(store, world, grid, &hostnames);
    if (!built.ok()) {
      // Tell every waiting rank (each waits on topo/done and its host's key), so that all fail with
      // the same message instead of timing out.
      for (const std::string& h : hostnames)
        store.Set(fmt::format("topo/host/{}", h), "!" + built.message()).IgnoreError();
      store.Set("topo/done", "!" + built.message()).IgnoreError();
      return built.WithContext("building the topology");
    }
  } else if (arrived > world) {
    return Internal("registration count {} exceeds {} ranks in {}", arrived, world, store.Describe());
  }
  // Every rank reads two small keys, in the one wait: the host count (written last) and its own
  // host's table -- not the host list, see ReadHosts().
  std::vector<std::optional<std::string>> got(2);
  {
    auto values = store.WaitGet({"topo/done", fmt::format("topo/host/{}", me.hostname)}, timeout);
    if (!values.ok()) {
      return values.status().WithContext(fmt::format(
          "rendezvous: rank {} waiting for all {} ranks to register ({} had when it did)", me.rank, world, arrived));
    }
    got[0] = (*values)[0];
    got[1] = (*values)[1];
  }
  if (!got[0]) return Internal("topology key vanished from {}", store.Describe());
  if (got[0]->starts_with("!")) return InvalidArgument("rendezvous failed: {}", got[0]->substr(1));
  if (!ParseInt(*got[0], &topo.num_hosts) || !got[1]) {
    return Internal("host {} of rank {} is missing from the topology", me.hostname, me.rank);
  }
  std::string_view table = *got[1];
  const size_t nl = table.find('\n');
  if (nl == std::string_view::npos || !ParseInt(table.substr(0, nl), &topo.host_index)) {
    return DataLoss("malformed host table '{}'", table);
  }
  for (auto entry : Split(table.substr(nl + 1), ',')) {
    auto rl = Split(entry, ':');
    int r = -1, l = -1;
    if (rl.size() != 2 || !ParseInt(rl[0], &r) || !ParseInt(rl[1], &l)) {
      return DataLoss("malformed host table entry '{}'", entry);
    }
    topo.host_ranks.push_back(r);
    if (r == me.rank) topo.local_rank = l;
  }
  topo.local_world = static_cast<int>(topo.host_ranks.size());
  if (topo.local_rank < 0) return Internal("rank {} is missing from its host table", me.rank);
  topo.phases.push_back(topo_clock.Done());
  return topo;
}

Result<std::vector<std::string>> Store::WaitGet(const std::vector<std::string>& keys, Millis timeout) {
  MS_RETURN_IF_ERROR(Wait(keys, timeout));
  MS_ASSIGN_OR_RETURN(auto values, MultiGet(keys));
  std::vector<std::string> out;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!values[i]) return NotFound("key '{}' vanished after Wait() in {}", keys[i], Describe());
    out.push_back(std::move(*values[i]));
  }
  return out;
}

Result<std::vector<std::string>> ReadHosts(Store& store) {
  MS_ASSIGN_OR_RETURN(std::string text, store.Get("topo/hosts"));
  std::vector<std::string> hosts;
  for (auto h : Split(text, '\n')) {
    if (!h.empty()) hosts.emplace_back(h);
  }
  return hosts;
}

Result<std::vector<RankInfo>> ReadRegistrations(Store& store, int world) {
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(fmt::format("reg/{}", r));
  MS_ASSIGN_OR_RETURN(auto blobs, store.MultiGet(keys));
  std::vector<RankInfo> out;
  for (int r = 0; r < world; ++r) {
    if (!blobs[r]) return NotFound("rank {} has not registered in {}", r, store.Describe());
    MS_ASSIGN_OR_RETURN(Registration reg, DecodeRegistration(*blobs[r]));
    out.push_back(reg.info);
  }
  return out;
}

Result<GroupIds> ExchangeGroupIds(Store& store, const ParallelGrid& grid, int rank,
                                  const GroupExchangeOptions& options) {
  GroupIds out;
  uint64_t seed =
      options.seed ? options.seed : static_cast<uint64_t>(NowSeconds() * 1e9) ^ (static_cast<uint64_t>(getpid()) << 32);
  Rng rng(seed, static_cast<uint64_t>(rank));
  auto new_id = [&] {
    std::string id;
    id.reserve(options.id_bytes);
    for (int i = 0; i < options.id_bytes; ++i) id.push_back("0123456789abcdef"[rng.NextBelow(16)]);
    return id;
  };
  auto id_key = [](GroupKind kind, int index) { return fmt::format("group/{}/{}/id", GroupKindName(kind), index); };
  // Leader writes, members wait and read. Size-1 groups need no exchange.
  auto obtain = [&](GroupKind kind, int index, const std::vector<int>& members, bool published) -> Result<std::string> {
    if (members.size() <= 1) return std::string();
    const std::string key = id_key(kind, index);
    if (members[0] == rank) {
      if (!published) {
        std::string id = new_id();
        MS_RETURN_IF_ERROR(store.Set(key, id));
        return id;
      }
      return out.id[static_cast<int>(kind)];
    }
    auto got = store.WaitGet({key}, options.timeout);
    if (!got.ok()) {
      return got.status().WithContext(fmt::format("rank {} waiting for the id of {} group {} (leader {})", rank,
                                                  GroupKindName(kind), index, members[0]));
    }
    return std::move((*got)[0]);
  };

  if (!options.baseline) {
    // 1. Publish the ids of every group this rank leads: nobody ever waits on a leader that is
    //    itself waiting.
    PhaseClock pub(store, "publish_ids");
    for (GroupKind kind : kAllGroupKinds) {
      std::vector<int> members = grid.Group(kind, rank);
      if (members.size() > 1 && members[0] == rank) {
        std::string id = new_id();
        MS_RETURN_IF_ERROR(store.Set(id_key(kind, grid.GroupIndex(kind, rank)), id));
        out.id[static_cast<int>(kind)] = id;
      }
    }
    out.phases.push_back(pub.Done());
    // 2. Read the others, kind by kind, and build each communicator.
    for (GroupKind kind : kAllGroupKinds) {
      PhaseClock clock(store, std::string(GroupKindName(kind)));
      std::vector<int> members = grid.Group(kind, rank);
      if (!members.empty()) {
        const int index = grid.GroupIndex(kind, rank);
        MS_ASSIGN_OR_RETURN(out.id[static_cast<int>(kind)], obtain(kind, index, members, true));
        if (options.on_group) {
          MS_RETURN_IF_ERROR_CTX(options.on_group(kind, index, members, out.id[static_cast<int>(kind)]),
                                 "creating {} group {}", GroupKindName(kind), index);
        }
      }
      out.phases.push_back(clock.Done());
    }
    return out;
  }

  // Baseline: every group of every kind in turn, each closed by a global barrier of all ranks.
  const int world = grid.world();
  int done = 0;
  for (GroupKind kind : kAllGroupKinds) {
    PhaseClock clock(store, std::string(GroupKindName(kind)));
    const int my_index = grid.GroupIndex(kind, rank);
    const int n = grid.NumGroups(kind);
    for (int g = 0; g < n; ++g) {
      if (options.baseline_max_groups > 0 && done >= options.baseline_max_groups) break;
      if (g == my_index) {
        std::vector<int> members = grid.Group(kind, rank);
        MS_ASSIGN_OR_RETURN(out.id[static_cast<int>(kind)], obtain(kind, g, members, false));
        if (options.on_group) {
          MS_RETURN_IF_ERROR_CTX(options.on_group(kind, g, members, out.id[static_cast<int>(kind)]),
                                 "creating {} group {}", GroupKindName(kind), g);
        }
      }
      MS_RETURN_IF_ERROR(StoreBarrier(store, fmt::format("baseline/barrier/{}", done), world, options.timeout));
      ++done;
    }
    out.phases.push_back(clock.Done());
  }
  out.baseline_groups_done = done;
  return out;
}

}  // namespace ms::bootstrap
