// checkpoint_bench: what a checkpoint costs training, on the file system given by --dir.
//
//   checkpoint_bench [--dir DIR] [--size-mb 512] [--ranks 1] [--no-dd] [--reserve]
//
// State: GPT-2-small-shaped layers (qkv [2304, 768], proj [768, 768], fc [3072, 768],
// proj [768, 3072], biases, norms) repeated until params + exp_avg + exp_avg_sq reach
// --size-mb (1536 is GPT-2 small's 124 M parameters x 3 kinds x fp32), split over --ranks
// ranks (each a thread with its own AsyncCheckpointer, ZeRO-style ranges).
// Reports: Snapshot time (training blocked; cold = first snapshot, staging pages faulted in;
// warm = later ones), synchronous save (Snapshot + Wait, what a blocking checkpoint costs),
// background write throughput, dd with O_DIRECT + fsync on the same directory, CRC32C and
// memcpy speed, and load time (open with full checksum verification + read every tensor,
// with the files' page cache dropped by posix_fadvise first, then warm).
#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "checkpoint/checkpoint.h"
#include "core/core.h"

namespace ms::checkpoint {
namespace {

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel;
};

std::vector<Tensor> Model(int64_t bytes_target) {
  const int64_t C = 768, F = 3072;
  std::vector<Tensor> t;
  int64_t total = 0;
  const int64_t per_layer = 3 * C * C + 3 * C + C * C + F * C + F + C * F + 4 * C;
  for (int l = 0; l == 0 || (total + per_layer) * 12 <= bytes_target; ++l) {
    std::string p = fmt::format("layers.{}.", l);
    const std::vector<std::pair<std::string, std::vector<int64_t>>> layer = {{"ln1.weight", {C}},
                                                                             {"ln1.bias", {C}},
                                                                             {"attn.qkv.weight", {3 * C, C}},
                                                                             {"attn.qkv.bias", {3 * C}},
                                                                             {"attn.proj.weight", {C, C}},
                                                                             {"attn.proj.bias", {C}},
                                                                             {"mlp.fc.weight", {F, C}},
                                                                             {"mlp.fc.bias", {F}},
                                                                             {"mlp.proj.weight", {C, F}},
                                                                             {"mlp.proj.bias", {C}}};
    for (const auto& [name, shape] : layer) {
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      t.push_back({p + name, shape, n});
      total += n;
    }
  }
  return t;
}

void DropCache(const std::string& dir) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    int fd = ::open(e.path().c_str(), O_RDONLY);
    if (fd < 0) continue;
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

int Run(const std::string& dir, int64_t size_mb, int ranks, bool run_dd, bool reserve) {
  const std::vector<std::string> kinds = {"param", "exp_avg", "exp_avg_sq"};
  const auto model = Model(size_mb << 20);
  int64_t numel = 0;
  for (const auto& t : model) numel += t.numel;
  const int64_t bytes = numel * 4 * 3;
  std::printf("state: %zu tensors x 3 kinds, %.1f M params, %.1f MB; %d rank(s); dir %s; %s, %d cores\n", model.size(),
              numel / 1e6, bytes / 1e6, ranks, dir.c_str(), HostName().c_str(), NumCores());

  // One flat buffer per kind (as the optimizer holds them), filled with a pattern.
  std::vector<std::vector<float>> state(3, std::vector<float>(static_cast<size_t>(numel)));
  for (size_t k = 0; k < 3; ++k) {
    for (int64_t i = 0; i < numel; ++i) state[k][i] = static_cast<float>(i % 1000) * 0.001f + k;
  }
  std::filesystem::remove_all(dir);

  // Each rank saves a contiguous 1/ranks of each kind's flat buffer (ZeRO-1 style ranges).
  InProcessCoordinator coord;
  std::vector<std::unique_ptr<AsyncCheckpointer>> cks;
  for (int r = 0; r < ranks; ++r) {
    CheckpointerOptions opt;
    opt.dir = dir;
    opt.rank = r;
    opt.layout = Layout{1, 1, ranks};
    opt.keep = 1;
    if (reserve) opt.reserve_bytes = static_cast<size_t>(bytes / ranks + (4 << 20));  // + alignment slack
    auto ck = AsyncCheckpointer::Create(opt, &coord);
    if (!ck.ok()) {
      std::fprintf(stderr, "error: %s\n", ck.status().message().c_str());
      return 1;
    }
    cks.push_back(std::move(ck).value());
  }
  std::vector<std::vector<PieceRef>> pieces(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r) {
    const int64_t z0 = numel * r / ranks, z1 = numel * (r + 1) / ranks;
    for (size_t k = 0; k < 3; ++k) {
      int64_t start = 0;
      for (const auto& t : model) {
        int64_t b = std::max<int64_t>(0, z0 - start), e = std::min<int64_t>(t.numel, z1 - start);
        if (e > b) {
          pieces[r].push_back(PieceRef{t.name, kinds[k], t.shape, model::ShardKind::kReplicated, 1, 0, b, e,
                                       state[k].data() + start + b});
        }
        start += t.numel;
      }
    }
  }

  struct Round {
    double blocked = 0, write = 0, total = 0;
  };
  auto round = [&](int64_t step) -> Round {
    Round out;
    const double t0 = NowSeconds();
    std::vector<double> blocked(static_cast<size_t>(ranks));
    std::vector<std::thread> th;
    for (int r = 0; r < ranks; ++r) {
      th.emplace_back([&, r] {
        auto info = cks[r]->Snapshot(step, pieces[r], fmt::format("{{\"step\": {}}}", step));
        blocked[r] = info.ok() ? info->blocked_seconds : -1;
      });
    }
    for (auto& t : th) t.join();
    for (double b : blocked) out.blocked = std::max(out.blocked, b);
    for (auto& ck : cks) {
      Status s = ck->Wait();
      if (!s.ok()) std::fprintf(stderr, "error: %s\n", s.message().c_str());
    }
    out.total = NowSeconds() - t0;
    out.write = cks[0]->LastWriteSeconds();
    return out;
  };
  Round cold = round(1);
  Round warm = round(2);
  Round warm2 = round(3);
  std::printf("\n%-52s %10s %12s\n", "measurement", "seconds", "GB/s");
  auto row = [&](const char* what, double s, double b) { std::printf("%-52s %10.3f %12.2f\n", what, s, b / s / 1e9); };
  row(reserve ? "snapshot, first (staging reserved at Create)" : "snapshot, first (training blocked; page faults)",
      cold.blocked, bytes);
  row("snapshot, warm (training blocked)", std::min(warm.blocked, warm2.blocked), bytes);
  row("synchronous save (snapshot + write + fsync)", std::min(warm.total, warm2.total), bytes);
  row("background write (rank 0: write + fsync + commit)", std::min(warm.write, warm2.write), bytes);

  {
    const double t0 = NowSeconds();
    uint32_t crc = 0;
    for (size_t k = 0; k < 3; ++k) crc = Crc32c(state[k].data(), state[k].size() * 4, crc);
    row(fmt::format("crc32c of the state (crc {:08x})", crc).c_str(), NowSeconds() - t0, bytes);
    std::vector<float> copy(state[0].size());
    std::memcpy(copy.data(), state[0].data(), copy.size() * 4);  // fault in
    const double t1 = NowSeconds();
    std::memcpy(copy.data(), state[1].data(), copy.size() * 4);
    row("memcpy (one kind, warm destination)", NowSeconds() - t1, static_cast<double>(copy.size()) * 4);
  }

  auto latest = std::string(dir) + "/" + StepDirName(3);
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 0) DropCache(dir);
    const double t0 = NowSeconds();
    auto c = FindLatestValid(dir, Verify::kFull);
    if (!c.ok()) {
      std::fprintf(stderr, "error: %s\n", c.status().message().c_str());
      return 1;
    }
    const double t1 = NowSeconds();
    std::vector<float> buf;
    bool same = true;
    for (size_t k = 0; k < 3; ++k) {
      int64_t start = 0;
      for (const auto& t : model) {
        buf.resize(static_cast<size_t>(t.numel));
        Status s = c->ReadGlobal(kinds[k], t.name, buf.data());
        if (!s.ok()) {
          std::fprintf(stderr, "error: %s\n", s.message().c_str());
          return 1;
        }
        same = same && std::memcmp(buf.data(), state[k].data() + start, buf.size() * 4) == 0;
        start += t.numel;
        c->DropCache();
      }
    }
    const double t2 = NowSeconds();
    row(pass == 0 ? "load: open + verify all checksums (cold cache)" : "load: open + verify all checksums (warm)",
        t1 - t0, bytes);
    row(pass == 0 ? "load: read every tensor (cold: after verify)" : "load: read every tensor (warm)", t2 - t1, bytes);
    if (!same) {
      std::fprintf(stderr, "error: loaded state differs from the saved one\n");
      return 1;
    }
  }

  if (run_dd) {
    const int64_t mb = bytes >> 20;
    std::string cmd = fmt::format("dd if=/dev/zero of={}/ddtest bs=1M count={} oflag=direct conv=fsync 2>&1", dir, mb);
    const double t0 = NowSeconds();
    FILE* p = ::popen(cmd.c_str(), "r");
    std::string out;
    char line[512];
    while (p && std::fgets(line, sizeof line, p)) out += line;
    int rc = p ? ::pclose(p) : -1;
    const double dt = NowSeconds() - t0;
    std::filesystem::remove(dir + "/ddtest");
    if (rc == 0) {
      row(fmt::format("dd O_DIRECT + fsync, {} MiB", mb).c_str(), dt, static_cast<double>(mb) * (1 << 20));
    } else {
      std::printf("dd failed (%s): %s\n", cmd.c_str(), out.c_str());
    }
    std::printf("  $ %s\n  %s", cmd.c_str(), out.substr(out.rfind('\n', out.size() - 2) + 1).c_str());
  }
  cks.clear();
  std::filesystem::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace ms::checkpoint

int main(int argc, char** argv) {
  CLI::App app{"checkpoint_bench: snapshot vs synchronous save, write throughput vs dd, load time"};
  std::string dir = "/tmp/ms-checkpoint-bench";
  int64_t size_mb = 512;
  int ranks = 1;
  bool no_dd = false, reserve = false;
  app.add_option("--dir", dir, "directory on the file system to measure (removed at the end)")->capture_default_str();
  app.add_option("--size-mb", size_mb, "params + 2 optimizer states, MB (1536 = GPT-2 small)")->capture_default_str();
  app.add_option("--ranks", ranks, "ranks saving concurrently (threads)")->capture_default_str();
  app.add_flag("--no-dd", no_dd, "skip the dd baseline");
  app.add_flag("--reserve", reserve, "set CheckpointerOptions::reserve_bytes (staging faulted in at Create)");
  CLI11_PARSE(app, argc, argv);
  if (ranks < 1 || size_mb < 1) {
    std::fprintf(stderr, "error: --ranks and --size-mb must be positive\n");
    return 1;
  }
  ms::SetLogLevel(ms::LogLevel::kWarn);
  return ms::checkpoint::Run(dir, size_mb, ranks, !no_dd, reserve);
}
