// `megascale self-check`: the worker's measurements, the driver's attempt, the analysis and the
// table (self_check.h).
#include "runner/self_check.h"

#include <omp.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <thread>

#include <fmt/ranges.h>

#include "bootstrap/bootstrap.h"
#include "cuda/cuda.h"
#include "fabric/fabric.h"
#include "metrics/metrics.h"
#include "ops/ops.h"
#include "runner/fault_injection.h"
#include "runner/rank.h"
#include "runner/run_dir.h"
#include "runner/signals.h"

namespace ms::runner {
namespace {

constexpr int kLatencyBytes = 8;
constexpr int kLatencyIterations = 20;  // round trips of a batch
constexpr int kLatencyBatches = 5;
constexpr size_t kStreamBytes = size_t{1} << 20;
constexpr int kStreamCount = 8;  // messages of a stream
constexpr int kStreamTries = 3;
constexpr double kLinkTimeoutS = 60;

std::string ResultKey(int rank) {
  return fmt::format("selfcheck/{}", rank);
}
std::string EndpointKey(int rank) {
  return fmt::format("selfcheck/ep/{}", rank);
}
std::string HostKey(int rank) {
  return fmt::format("selfcheck/host/{}", rank);
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The GEMM rate of this rank's device: 7 timed n x n x n products after a warm-up, the best;
// a slow_gemm injection stretches each by its factor.
Result<double> GemmRate(ops::Backend* backend, int64_t n, double slow_factor) {
  const size_t count = static_cast<size_t>(n * n);
  std::vector<float> ha(count), hb(count), hc(count);
  Rng rng(7);
  for (auto& x : ha) x = static_cast<float>(rng.NextDouble() - 0.5);
  for (auto& x : hb) x = static_cast<float>(rng.NextDouble() - 0.5);
  std::optional<device::Buffer> a, w, out;
  if (backend) {
    MS_ASSIGN_OR_RETURN(a, device::Buffer::Allocate(backend->device(), count));
    MS_ASSIGN_OR_RETURN(w, device::Buffer::Allocate(backend->device(), count));
    MS_ASSIGN_OR_RETURN(out, device::Buffer::Allocate(backend->device(), count));
    MS_RETURN_IF_ERROR(backend->CopyFromHost(a->data(), ha.data(), count * sizeof(float)));
    MS_RETURN_IF_ERROR(backend->CopyFromHost(w->data(), hb.data(), count * sizeof(float)));
  }
  double best = 0;
  for (int i = 0; i < 8; ++i) {  // the best of 7: a moment descheduled on a busy host is not a slow device
    const double t0 = NowSeconds();
    if (backend) {
      MS_RETURN_IF_ERROR(backend->MatmulForward(out->f32(), a->f32(), w->f32(), nullptr, n, n, n));
      MS_RETURN_IF_ERROR(backend->Synchronize());
    } else {
      ops::Gemm(false, false, n, n, n, 1.0f, ha.data(), n, hb.data(), n, 0.0f, hc.data(), n);
    }
    if (slow_factor > 1) BurnCpu((slow_factor - 1) * (NowSeconds() - t0));
    const double dt = NowSeconds() - t0;
    if (i > 0 && dt > 0) best = std::max(best, 2.0 * static_cast<double>(n) * n * n / dt);  // the first warms up
  }
  return best;
}

// Host memory bandwidth: bytes read plus written per second by memcpy of `bytes`, the best of 5.
double MemoryBandwidth(size_t bytes) {
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const double t0 = NowSeconds();
    std::memcpy(dst.data(), src.data(), bytes);
    const double dt = NowSeconds() - t0;
    src[static_cast<size_t>(i)] = dst[bytes - 1 - static_cast<size_t>(i)];  // keeps the copy observable
    if (dt > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / dt);
  }
  return best;
}

// The rounds of a round-robin tournament over `n` endpoints (the circle method): every pair once,
// each endpoint in at most one pair per round.
std::vector<std::vector<std::pair<int, int>>> RoundRobin(int n) {
  std::vector<std::vector<std::pair<int, int>>> rounds;
  if (n < 2) return rounds;
  const int m = n % 2 ? n + 1 : n;  // with a bye
  std::vector<int> ring(m);
  for (int i = 0; i < m; ++i) ring[i] = i;
  for (int r = 0; r < m - 1; ++r) {
    std::vector<std::pair<int, int>> round;
    for (int i = 0; i < m / 2; ++i) {
      const int a = ring[i], b = ring[m - 1 - i];
      if (a < n && b < n) round.emplace_back(std::min(a, b), std::max(a, b));
    }
    rounds.push_back(std::move(round));
    std::rotate(ring.begin() + 1, ring.end() - 1, ring.end());
  }
  return rounds;
}

// One pair's test, run by both ends: latency (ping-pong) and bandwidth both ways; the lower rank
// gets the result (the upper sends it its own direction's figure). Each figure is the best of a few
// tries (the lowest latency of 5 batches, the highest bandwidth of 3 streams): on a shared host a
// process that is descheduled for a moment must not look like a slow link.
Status TestLink(fabric::Endpoint& ep, uint64_t peer, bool lower, RankCheck::Link* link) {
  // A first exchange of large messages sets up what the provider needs (connections, bounce
  // buffers, registrations): without it an endpoint's first link measures several times slower.
  MS_RETURN_IF_ERROR(fabric::Stream(ep, peer, lower, kStreamBytes, kStreamCount).status());
  MS_RETURN_IF_ERROR(fabric::Stream(ep, peer, !lower, kStreamBytes, kStreamCount).status());
  double latency = 0, up = 0, down = 0;
  for (int i = 0; i < kLatencyBatches; ++i) {
    MS_ASSIGN_OR_RETURN(double t, fabric::PingPong(ep, peer, lower, kLatencyBytes, kLatencyIterations));
    latency = i == 0 ? t : std::min(latency, t);
  }
  for (int i = 0; i < kStreamTries; ++i) {
    MS_ASSIGN_OR_RETURN(double a, fabric::Stream(ep, peer, lower, kStreamBytes, kStreamCount));
    MS_ASSIGN_OR_RETURN(double b, fabric::Stream(ep, peer, !lower, kStreamBytes, kStreamCount));
    up = std::max(up, a);
    down = std::max(down, b);
  }
  if (lower) {
    double theirs = 0;
    MS_RETURN_IF_ERROR(ep.Recv(&theirs, sizeof theirs, peer, kLinkTimeoutS));
    link->latency_s = latency;
    link->bytes_per_s = std::min(up, theirs);
  } else {
    MS_RETURN_IF_ERROR(ep.Send(&down, sizeof down, peer, kLinkTimeoutS));
  }
  return Status::Ok();
}

std::string OneLine(std::string s) {
  std::replace(s.begin(), s.end(), '\n', ' ');
  return s;
}

std::string Rate(double bytes_per_s) {
  return bytes_per_s >= 1e9 ? fmt::format("{:.2f} GB/s", bytes_per_s / 1e9)
                            : fmt::format("{:.0f} MB/s", bytes_per_s / 1e6);
}

}  // namespace

std::string FormatRankCheck(const RankCheck& r) {
  std::string out = fmt::format("rank={}\nhost={}\nlocal_rank={}\nprovider={}\ngemm={:.9g}\nmemory={:.9g}\n", r.rank,
                                r.host, r.local_rank, r.provider, r.gemm_flops, r.memory_bytes_per_s);
  for (const auto& l : r.links) {
    out += fmt::format("link={} {} {:.9g} {:.9g}\n", l.peer, l.peer_host, l.latency_s, l.bytes_per_s);
  }
  out += fmt::format("allreduce={:.9g} {:.9g}\n", r.allreduce_s, r.allreduce_bus_bytes_per_s);
  for (const auto& e : r.errors) out += "error=" + OneLine(e) + "\n";
  return out;
}

Result<RankCheck> ParseRankCheck(const std::string& text) {
  RankCheck r;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(start, end - start);
    start = end + 1;
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    const std::string key = line.substr(0, eq), value = line.substr(eq + 1);
    if (key == "rank") {
      r.rank = std::atoi(value.c_str());
    } else if (key == "host") {
      r.host = value;
    } else if (key == "local_rank") {
      r.local_rank = std::atoi(value.c_str());
    } else if (key == "provider") {
      r.provider = value;
    } else if (key == "gemm") {
      r.gemm_flops = std::strtod(value.c_str(), nullptr);
    } else if (key == "memory") {
      r.memory_bytes_per_s = std::strtod(value.c_str(), nullptr);
    } else if (key == "link") {
      RankCheck::Link l;
      char host[256] = {0};
      if (std::sscanf(value.c_str(), "%d %255s %lf %lf", &l.peer, host, &l.latency_s, &l.bytes_per_s) != 4) {
        return DataLoss("self-check result: malformed link line '{}'", line);
      }
      l.peer_host = host;
      r.links.push_back(l);
    } else if (key == "allreduce") {
      if (std::sscanf(value.c_str(), "%lf %lf", &r.allreduce_s, &r.allreduce_bus_bytes_per_s) != 2) {
        return DataLoss("self-check result: malformed all-reduce line '{}'", line);
      }
    } else if (key == "error") {
      r.errors.push_back(value);
    }
  }
  if (r.rank < 0) return DataLoss("self-check result without a rank");
  return r;
}

SelfCheckReport AnalyzeSelfCheck(std::vector<RankCheck> ranks, double tolerance) {
  SelfCheckReport rep;
  std::sort(ranks.begin(), ranks.end(), [](const RankCheck& a, const RankCheck& b) { return a.rank < b.rank; });
  rep.ranks = ranks;
  const double k = 1 + tolerance;
  auto fail = [&](const std::string& host, std::string line) {
    rep.failures.push_back(std::move(line));
    if (!host.empty()) rep.bad_hosts.insert(host);
  };
  for (const RankCheck& r : ranks) {
    for (const std::string& e : r.errors) fail(r.host, fmt::format("rank {} on {}: {}", r.rank, r.host, e));
  }
  std::string& t = rep.table;
  // GEMM per rank.
  std::vector<double> gemm;
  for (const RankCheck& r : ranks) {
    if (r.gemm_flops > 0) gemm.push_back(r.gemm_flops);
  }
  const double gemm_median = Median(gemm);
  t += fmt::format("{:>5}  {:<20} {:>14}\n", "rank", "host", "GEMM GFLOP/s");
  for (const RankCheck& r : ranks) {
    std::string mark;
    if (r.gemm_flops > 0 && r.gemm_flops * k < gemm_median) {
      mark = fmt::format("  SLOW ({:.1f}x below the median)", gemm_median / r.gemm_flops);
      fail(r.host, fmt::format("rank {} on {}: GEMM {:.1f} GFLOP/s, {:.1f}x below the median of {:.1f}", r.rank, r.host,
                               r.gemm_flops / 1e9, gemm_median / r.gemm_flops, gemm_median / 1e9));
    }
    t += fmt::format("{:>5}  {:<20} {:>14}{}\n", r.rank, r.host,
                     r.gemm_flops > 0 ? fmt::format("{:.1f}", r.gemm_flops / 1e9) : std::string("-"), mark);
  }
  // Memory per host.
  std::vector<double> mem;
  for (const RankCheck& r : ranks) {
    if (r.memory_bytes_per_s > 0) mem.push_back(r.memory_bytes_per_s);
  }
  const double mem_median = Median(mem);
  t += fmt::format("\n{:<20} {:>16}\n", "host", "memory (memcpy)");
  for (const RankCheck& r : ranks) {
    if (r.memory_bytes_per_s <= 0) continue;
    std::string mark;
    if (r.memory_bytes_per_s * k < mem_median) {
      mark = fmt::format("  SLOW ({:.1f}x below the median)", mem_median / r.memory_bytes_per_s);
      fail(r.host, fmt::format("host {}: memory bandwidth {}, {:.1f}x below the median of {}", r.host,
                               Rate(r.memory_bytes_per_s), mem_median / r.memory_bytes_per_s, Rate(mem_median)));
    }
    t += fmt::format("{:<20} {:>16}{}\n", r.host, Rate(r.memory_bytes_per_s), mark);
  }
  // Links: every pair, then each endpoint's median against the median over endpoints.
  std::map<int, std::vector<double>> ep_latency, ep_bandwidth;
  std::map<int, std::string> ep_host;
  std::vector<std::pair<int, RankCheck::Link>> links;
  for (const RankCheck& r : ranks) {
    for (const auto& l : r.links) {
      links.emplace_back(r.rank, l);
      ep_latency[r.rank].push_back(l.latency_s);
      ep_latency[l.peer].push_back(l.latency_s);
      ep_bandwidth[r.rank].push_back(l.bytes_per_s);
      ep_bandwidth[l.peer].push_back(l.bytes_per_s);
      ep_host[r.rank] = r.host;
      ep_host[l.peer] = l.peer_host;
    }
  }
  if (!links.empty()) {
    const std::string provider = ranks.empty() ? "" : ranks.front().provider;
    t += fmt::format("\nlibfabric point-to-point ({}): one-way latency of {} B, bandwidth of {} x {} MiB each way\n",
                     provider, kLatencyBytes, kStreamCount, kStreamBytes >> 20);
    t += fmt::format("{:<34} {:>12} {:>14}\n", "link", "latency", "bandwidth");
    for (const auto& [from, l] : links) {
      t += fmt::format("{:<34} {:>9.1f} us {:>14}\n",
                       fmt::format("rank {} ({}) - rank {} ({})", from, ep_host[from], l.peer, l.peer_host),
                       l.latency_s * 1e6, Rate(l.bytes_per_s));
    }
    std::vector<double> lat_scores, bw_scores;
    for (auto& [rank, v] : ep_latency) lat_scores.push_back(Median(v));
    for (auto& [rank, v] : ep_bandwidth) bw_scores.push_back(Median(v));
    if (ep_latency.size() >= 3) {
      const double lat_median = Median(lat_scores), bw_median = Median(bw_scores);
      for (auto& [rank, v] : ep_latency) {
        const double lat = Median(v), bw = Median(ep_bandwidth[rank]);
        if (lat > lat_median * k) {
          fail(ep_host[rank],
               fmt::format("rank {} on {}: link latency {:.1f} us (median over its {} links), {:.1f}x "
                           "above the median of {:.1f} us",
                           rank, ep_host[rank], lat * 1e6, v.size(), lat / lat_median, lat_median * 1e6));
        }
        if (bw * k < bw_median) {
          fail(ep_host[rank], fmt::format("rank {} on {}: link bandwidth {} (median over its {} links), {:.1f}x below "
                                          "the median of {}",
                                          rank, ep_host[rank], Rate(bw), v.size(), bw_median / bw, Rate(bw_median)));
        }
      }
    } else {
      t += "(two endpoints: a slow link cannot be told from a slow endpoint; links are not judged)\n";
    }
  }
  for (const RankCheck& r : ranks) {
    if (r.allreduce_s > 0) {
      t += fmt::format("\nall-reduce over the job's world communicator: 16 MiB in {:.1f} ms, bus bandwidth {}\n",
                       r.allreduce_s * 1e3, Rate(r.allreduce_bus_bytes_per_s));
      break;
    }
  }
  return rep;
}

Status RunSelfCheckWorker(const std::string& job_spec_path, const SelfCheckOptions& options) {
  InstallStopSignals();
  const double worker_start = WallSeconds();
  MS_ASSIGN_OR_RETURN(config::JobSpec spec, config::LoadJobSpec(job_spec_path));
  MS_RETURN_IF_ERROR(config::ResolveAndValidate(&spec));
  MS_ASSIGN_OR_RETURN(std::unique_ptr<Runtime> rt, JoinJob(spec, worker_start));
  MS_RETURN_IF_ERROR(MakeDirs(spec.log.run_dir + "/logs"));
  MS_RETURN_IF_ERROR(SetLogFile(fmt::format("{}/logs/self-check-rank-{}.log", spec.log.run_dir, rt->rank)));
  struct CloseLog {
    ~CloseLog() { SetLogFile("").IgnoreError(); }
  } close_log;
  LogInfo("self-check: rank {} of {} on {} (local rank {} of {})", rt->rank, rt->world, rt->host.name,
          rt->host.local_rank, rt->host.local_world);
  // The compute threads of a training rank (the GEMM test measures what training gets).
  omp_set_num_threads(spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, rt->host.cpus_per_rank));
  comm::Communicator& world = *rt->world_comm;
  RankCheck me;
  me.rank = rt->rank;
  me.host = rt->host.name;
  me.local_rank = rt->host.local_rank;
  auto barrier = [&](const char* after) -> Status {
    MS_RETURN_IF_ERROR_CTX(world.Barrier(), "self-check barrier after the {} test", after);
    return Status::Ok();
  };
  // The most ranks on any host: the turns of the CPU GEMM test.
  int64_t turns = rt->host.local_world;
  MS_RETURN_IF_ERROR(world.AllReduce(&turns, 1, comm::ReduceOp::kMax)->Wait());

  // 1. GEMM.
  auto compute = MakeCompute(spec, *rt);
  if (!compute.ok()) {
    me.errors.push_back("device: " + compute.status().message());
  }
  ops::Backend* backend = compute.ok() ? compute->backend.get() : nullptr;
  const bool shared_device = backend == nullptr;  // the CPU: the ranks of a host take turns
  const bool emulated = backend && cuda::LinkedFlavor() == cuda::Flavor::kEmulated;
  const int64_t n = backend ? (emulated ? 96 : 8192) : 512;
  for (int64_t turn = 0; turn < (shared_device ? turns : 1); ++turn) {
    if (compute.ok() && (!shared_device || turn == rt->host.local_rank)) {
      auto rate = GemmRate(backend, n, InjectedFactor("slow_gemm", rt->rank));
      if (rate.ok()) {
        me.gemm_flops = *rate;
      } else {
        me.errors.push_back("GEMM: " + rate.status().message());
      }
    }
    if (shared_device) MS_RETURN_IF_ERROR(barrier("GEMM"));
  }
  if (!shared_device) MS_RETURN_IF_ERROR(barrier("GEMM"));
  LogInfo("self-check: GEMM {}^3: {:.1f} GFLOP/s", n, me.gemm_flops / 1e9);

  // 2. Host memory.
  if (rt->host.local_rank == 0) me.memory_bytes_per_s = MemoryBandwidth(size_t{64} << 20);
  MS_RETURN_IF_ERROR(barrier("memory"));

  // 3. Links over libfabric: the hosts' local rank 0, or every rank on a one-host job.
  const bool by_host = rt->host.num_hosts > 1;
  std::vector<int> endpoints;  // ranks taking part, in order
  std::unique_ptr<fabric::Endpoint> ep;
  const bool taking_part = !by_host || rt->host.local_rank == 0;
  std::string name;
  if (taking_part) {
    auto opened = fabric::Endpoint::Open(options.provider);
    if (opened.ok()) {
      ep = std::move(opened).value();
      ep->set_slowdown(InjectedFactor("slow_link", rt->rank));
      me.provider = ep->provider();
      name = ep->Name();
    } else {
      me.errors.push_back(fmt::format("libfabric provider {}: {}", options.provider, opened.status().message()));
    }
  }
  // Every rank publishes its endpoint ("-": not taking part, "none": it has none) and its host.
  MS_RETURN_IF_ERROR(rt->store->Set(EndpointKey(rt->rank), taking_part ? (name.empty() ? "none" : name) : "-"));
  MS_RETURN_IF_ERROR(rt->store->Set(HostKey(rt->rank), me.host));
  std::vector<std::string> keys;
  for (int r = 0; r < rt->world; ++r) keys.push_back(EndpointKey(r));
  for (int r = 0; r < rt->world; ++r) keys.push_back(HostKey(r));
  const bootstrap::Millis timeout(static_cast<int64_t>(spec.runtime.rendezvous_timeout_s * 1000));
  MS_ASSIGN_OR_RETURN(std::vector<std::string> published, rt->store->WaitGet(keys, timeout));
  const std::vector<std::string> names(published.begin(), published.begin() + rt->world);
  const std::vector<std::string> host_of(published.begin() + rt->world, published.end());
  for (int r = 0; r < rt->world; ++r) {
    if (names[r] != "-") endpoints.push_back(r);
  }
  std::map<int, uint64_t> peers;
  if (ep) {
    for (int r : endpoints) {
      if (r == rt->rank || names[r] == "none") continue;
      auto handle = ep->AddPeer(names[r]);
      if (handle.ok()) {
        peers[r] = *handle;
      } else {
        me.errors.push_back(fmt::format("libfabric: adding rank {}'s address: {}", r, handle.status().message()));
      }
    }
  }
  // The schedule: round-robin rounds across hosts (pairs at once); on one host one pair at a time.
  std::vector<std::vector<std::pair<int, int>>> slots;
  for (auto& round : RoundRobin(static_cast<int>(endpoints.size()))) {
    std::vector<std::pair<int, int>> ranked;
    for (auto [a, b] : round) ranked.emplace_back(endpoints[a], endpoints[b]);
    if (by_host) {
      slots.push_back(ranked);
    } else {
      for (auto& p : ranked) slots.push_back({p});
    }
  }
  for (const auto& slot : slots) {
    for (auto [a, b] : slot) {
      if (a != rt->rank && b != rt->rank) continue;
      const int other = a == rt->rank ? b : a;
      const bool lower = rt->rank < other;
      if (!ep || !peers.count(other)) {
        if (lower) me.errors.push_back(fmt::format("link to rank {}: not tested (an endpoint is missing)", other));
        continue;
      }
      RankCheck::Link link;
      link.peer = other;
      link.peer_host = host_of[other];
      Status s = TestLink(*ep, peers[other], lower, &link);
      if (!s.ok()) {
        me.errors.push_back(fmt::format("link to rank {} on {}: {}", other, host_of[other], s.message()));
      } else if (lower) {
        me.links.push_back(link);
        LogInfo("self-check: link to rank {}: {:.1f} us, {}", other, link.latency_s * 1e6, Rate(link.bytes_per_s));
      }
    }
    MS_RETURN_IF_ERROR(barrier("link"));
  }
  ep.reset();

  // 4. All-reduce over the world communicator.
  if (rt->world > 1) {
    const int64_t count = 4 << 20;  // 16 MiB of floats
    std::vector<float> buf(static_cast<size_t>(count));
    const float expected = static_cast<float>(rt->world) * (rt->world + 1) / 2;
    double best = 0;
    for (int rep = 0; rep < 4; ++rep) {
      std::fill(buf.begin(), buf.end(), static_cast<float>(rt->rank + 1));
      MS_RETURN_IF_ERROR(barrier("all-reduce"));
      const double t0 = NowSeconds();
      MS_RETURN_IF_ERROR(world.AllReduce(buf.data(), count, comm::ReduceOp::kSum)->Wait());
      const double dt = NowSeconds() - t0;
      if (rep > 0 && (best == 0 || dt < best)) best = dt;
      if (buf.front() != expected || buf.back() != expected || buf[buf.size() / 2] != expected) {
        me.errors.push_back(fmt::format("all-reduce: wrong sum {} (expected {})", buf.front(), expected));
        break;
      }
    }
    me.allreduce_s = best;
    if (best > 0) {
      me.allreduce_bus_bytes_per_s = 2.0 * (rt->world - 1) / rt->world * static_cast<double>(count) * 4 / best;
    }
  }
  MS_RETURN_IF_ERROR(rt->store->Set(ResultKey(rt->rank), FormatRankCheck(me)));
  LogInfo("self-check: done{}", me.errors.empty() ? "" : fmt::format(" with {} error(s)", me.errors.size()));
  return Status::Ok();
}

Result<SelfCheckReport> RunSelfCheckAttempt(const config::JobSpec& spec, const JobStore& store, const Placement& where,
                                            const std::string& job_id, int attempt, const SelfCheckOptions& options) {
  const int world = static_cast<int>(config::WorldSize(spec.parallel));
  MS_ASSIGN_OR_RETURN(const std::string exe, SelfExecutable());
  LaunchPlan plan;
  plan.exe = exe;
  plan.world = world;
  const std::string spec_path = spec.log.run_dir + "/job.yaml";
  plan.args = [&](int) {
    return std::vector<std::string>{"worker",     spec_path,        "--self-check",
                                    "--provider", options.provider, "--no-progress"};
  };
  plan.env = RankEnvironment(world, store, job_id, attempt);
  const double t0 = NowSeconds();
  MS_ASSIGN_OR_RETURN(std::unique_ptr<Attempt> launched,
                      LaunchAttempt(std::move(plan), where, fmt::format("megascale-{}-{}", job_id, attempt),
                                    fmt::format("self-check (provider {})", options.provider)));
  // Each test is bounded (collective and link timeouts); this is the backstop.
  const double deadline = NowSeconds() + spec.runtime.rendezvous_timeout_s + 4 * spec.runtime.collective_timeout_s +
                          4 * kLinkTimeoutS + world;
  std::vector<RankExit> exits;
  while (!launched->AllExited()) {
    const SignalCounts sig = TakeSignals();
    if (sig.terminate || sig.interrupt) {
      launched->Kill();
      return Aborted("self-check stopped by {}", sig.terminate ? "SIGTERM" : "SIGINT");
    }
    if (NowSeconds() > deadline) {
      LogError("self-check: ranks {} still running after {:.0f} s; killing them", fmt::join(launched->Running(), ", "),
               NowSeconds() - t0);
      launched->Kill();
    }
    for (RankExit& e : launched->Poll()) exits.push_back(e);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (RankExit& e : launched->Poll()) exits.push_back(e);
  launched.reset();
  // The results, through the driver's own connection to the attempt's namespace.
  bootstrap::StoreOptions so;
  so.url = store.url;
  so.password = store.password;
  so.job_id = job_id;
  so.attempt = attempt;
  MS_ASSIGN_OR_RETURN(auto reader, bootstrap::ConnectRedisStore(so));
  std::vector<std::string> keys;
  for (int r = 0; r < world; ++r) keys.push_back(ResultKey(r));
  MS_ASSIGN_OR_RETURN(auto texts, reader->MultiGet(keys));
  std::vector<RankCheck> ranks;
  for (int r = 0; r < world; ++r) {
    RankCheck rc;
    if (texts[r]) {
      auto parsed = ParseRankCheck(*texts[r]);
      if (parsed.ok()) {
        rc = std::move(parsed).value();
      } else {
        rc.rank = r;
        rc.errors.push_back(parsed.status().message());
      }
    } else {
      rc.rank = r;
      std::string how = "it did not finish";
      for (const RankExit& e : exits) {
        if (e.rank == r) {
          rc.host = e.host;
          how = fmt::format("it ended ({})", DescribeExit(e.status));
        }
      }
      auto said = reader->Get(fmt::format("error/{}", r));
      const std::string log = fmt::format("{}/logs/self-check-rank-{}.log", spec.log.run_dir, r);
      rc.errors.push_back(fmt::format("no result: {}{}{}", how, said.ok() ? ": " + *said : std::string(),
                                      std::filesystem::exists(log) ? "; its log: " + log : std::string()));
    }
    ranks.push_back(std::move(rc));
  }
  SelfCheckReport report = AnalyzeSelfCheck(std::move(ranks), options.tolerance);
  // The table, and one JSON object per rank for scripts.
  std::string jsonl;
  for (const RankCheck& r : report.ranks) {
    metrics::JsonObject o;
    o.Add("rank", r.rank).Add("host", r.host).Add("gemm_flops", r.gemm_flops);
    o.Add("memory_bytes_per_s", r.memory_bytes_per_s).Add("provider", r.provider);
    o.Add("allreduce_s", r.allreduce_s).Add("allreduce_bus_bytes_per_s", r.allreduce_bus_bytes_per_s);
    std::string links;
    for (const auto& l : r.links) {
      links += fmt::format("{}{}:{:.9g}:{:.9g}", links.empty() ? "" : ",", l.peer, l.latency_s, l.bytes_per_s);
    }
    o.Add("links", links);
    std::string errors;
    for (const auto& e : r.errors) errors += (errors.empty() ? "" : "; ") + e;
    o.Add("errors", errors);
    jsonl += o.str() + "\n";
  }
  WriteFileAtomic(spec.log.run_dir + "/self_check.jsonl", jsonl).IgnoreError();
  std::string text = fmt::format("self-check of {} rank{} ({:.1f} s, tolerance {:.0f}% of the median):\n", world,
                                 world == 1 ? "" : "s", NowSeconds() - t0, options.tolerance * 100);
  text += report.table;
  if (report.passed()) {
    text += "self-check passed\n";
  } else {
    text += fmt::format("self-check FAILED ({} problem{}):\n", report.failures.size(),
                        report.failures.size() == 1 ? "" : "s");
    for (const auto& f : report.failures) text += "  " + f + "\n";
  }
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
  return report;
}

Result<bool> RunSelfCheck(const config::JobSpec& spec, const SelfCheckOptions& options) {
  InstallStopSignals();
  MS_RETURN_IF_ERROR(PreflightCheck(spec, /*files=*/false));
  const std::string holder =
      fmt::format("self-check, pid {} on host {}, started {}", getpid(), HostName(), WallClockIso8601());
  MS_ASSIGN_OR_RETURN(DirLock run_lock, DirLock::Acquire(spec.log.run_dir, "log.run_dir", holder));
  const int world = static_cast<int>(config::WorldSize(spec.parallel));
  MS_RETURN_IF_ERROR(WriteFileAtomic(spec.log.run_dir + "/job.yaml", config::ToYaml(spec)));
  MS_ASSIGN_OR_RETURN(auto alloc, cluster::ReadSlurmAllocation());
  Placement where;
  if (alloc) {
    where.alloc = &*alloc;
    MS_ASSIGN_OR_RETURN(where.fit, FitSlurmAllocation(spec, *alloc));
  }
  where.threads = spec.runtime.threads > 0 ? spec.runtime.threads : std::max(1, NumCores() / world);
  MS_ASSIGN_OR_RETURN(JobStore store, StartJobStore(spec, where.alloc, world));
  auto report = RunSelfCheckAttempt(spec, store, where, JobId(spec.name + "-selfcheck"), 0, options);
  if (store.redis) store.redis->Stop().IgnoreError();
  if (!report.ok()) return report.status();
  return report->passed();
}

}  // namespace ms::runner
