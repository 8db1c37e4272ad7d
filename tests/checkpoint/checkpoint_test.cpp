// Checkpoint tests: format helpers, save under (tp 2, pp 2, dp 2) with ZeRO ranges from 8
// concurrent "ranks" and read back bit-exact under tp 1 and tp 4 (cross-checked with
// model::ExtractShard), damage detection and fallback, retention, disk full, unwritable
// directories, overlap policies, SIGKILL safety, and the safetensors export (checked by Python).
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "checkpoint/checkpoint.h"
#include "checkpoint/internal.h"
#include "checkpoint/test_util.h"

namespace ms::checkpoint {
namespace {

using namespace testing;  // NOLINT

// Bitwise CRC32C, the definition.
uint32_t Crc32cBitwise(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
  }
  return ~c;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

void CheckGlobalsEqual(const Checkpoint& c, const Truth& truth) {
  for (const auto& kind : Kinds()) {
    CHECK(c.tensors(kind).size() == FakeModel().size());
    for (const auto& t : FakeModel()) {
      std::vector<float> got(static_cast<size_t>(Numel(t.shape)), -1.f);
      Status s = c.ReadGlobal(kind, t.name, got.data());
      REQUIRE_MESSAGE(s.ok(), s.ToString());
      CHECK_MESSAGE(SameBits(got, truth.at(kind).at(t.name)), kind, " ", t.name);
    }
  }
}

// Flips one byte of a file in place.
void FlipByte(const std::string& path, int64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char b = 0;
  REQUIRE(::pread(fd, &b, 1, offset) == 1);
  b ^= 0x5A;
  REQUIRE(::pwrite(fd, &b, 1, offset) == 1);
  REQUIRE(::close(fd) == 0);
}

std::string Slurp(const std::string& path) {
  auto r = ReadFile(path);
  return r.ok() ? *r : std::string("<unreadable>");
}

// A tmpfs mounted for the life of the object (root only); mounted() false where not permitted.
class TmpfsMount {
 public:
  TmpfsMount(const std::string& path, const char* options, unsigned long flags = 0) : path_(path) {
    std::filesystem::create_directories(path);
    mounted_ = ::mount("tmpfs", path.c_str(), "tmpfs", flags, options) == 0;
    if (!mounted_) error_ = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted_) ::umount2(path_.c_str(), MNT_DETACH);
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_, error_;
  bool mounted_ = false;
};

// One-rank save of `n` floats of one tensor.
Result<SnapshotInfo> SaveOne(AsyncCheckpointer& ck, int64_t step, const std::vector<float>& v) {
  PieceRef p{"w",
             "param",
             {static_cast<int64_t>(v.size())},
             ShardKind::kReplicated,
             1,
             0,
             0,
             static_cast<int64_t>(v.size()),
             v.data()};
  return ck.Snapshot(step, {p}, fmt::format("{{\"step\": {}}}", step));
}

std::vector<float> Values(size_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(rng.NextNormal());
  return v;
}

TEST_CASE("crc32c matches the definition, in hardware and software") {
  CHECK(Crc32c("123456789", 9) == 0xE3069283u);
  CHECK(internal::Crc32cPortable("123456789", 9) == 0xE3069283u);
  CHECK(Crc32c("", 0) == 0u);
  Rng rng(7);
  std::vector<uint8_t> buf(5000);
  for (auto& b : buf) b = static_cast<uint8_t>(rng.NextU64());
  for (int trial = 0; trial < 50; ++trial) {
    size_t off = rng.NextBelow(16), n = rng.NextBelow(buf.size() - 16);
    uint32_t want = Crc32cBitwise(buf.data() + off, n);
    CHECK(Crc32c(buf.data() + off, n) == want);
    CHECK(internal::Crc32cPortable(buf.data() + off, n) == want);
    size_t cut = n ? rng.NextBelow(n) : 0;  // continuation
    CHECK(Crc32c(buf.data() + off + cut, n - cut, Crc32c(buf.data() + off, cut)) == want);
    CHECK(internal::Crc32cCombine(Crc32c(buf.data() + off, cut), Crc32c(buf.data() + off + cut, n - cut), n - cut) ==
          want);
  }
}

TEST_CASE("file info survives JSON, including awkward metadata") {
  FileInfo f;
  f.rank = 3;
  f.name = RankFileName(3);
  f.size = 123456789012;
  f.crc32c = 0xFFFFFFFFu;
  f.metadata = "{\"rng\": [1, 2]}\nline 2\t\"quoted\" \\ back\x01\x1f caf\xc3\xa9";
  f.pieces.push_back(
      PieceInfo{"layers.0.attn.qkv.weight", "exp_avg", {48, 16}, ShardKind::kQkvRows, 4, 3, 5, 96, 4096, 0x12345678u});
  auto back = FileInfo::FromJson(f.ToJson());
  REQUIRE_MESSAGE(back.ok(), back.status().ToString());
  CHECK(back->rank == 3);
  CHECK(back->name == "rank-00003.bin");
  CHECK(back->size == f.size);
  CHECK(back->crc32c == f.crc32c);
  CHECK(back->metadata == f.metadata);
  REQUIRE(back->pieces.size() == 1);
  const PieceInfo& p = back->pieces[0];
  CHECK(p.tensor == "layers.0.attn.qkv.weight");
  CHECK(p.kind == "exp_avg");
  CHECK(p.global_shape == std::vector<int64_t>{48, 16});
  CHECK(p.shard == ShardKind::kQkvRows);
  CHECK((p.tp_size == 4 && p.tp_rank == 3 && p.begin == 5 && p.end == 96 && p.offset == 4096));
  CHECK(p.crc32c == 0x12345678u);
  CHECK(!FileInfo::FromJson("{\"rank\": 1").ok());
  CHECK(!FileInfo::FromJson("[1, 2]").ok());
  auto escaped = internal::ParseJson("\"\\u00e9\\ud83d\\ude00\\/\"");
  REQUIRE(escaped.ok());
  CHECK(escaped->str == "\xc3\xa9\xf0\x9f\x98\x80/");
}

TEST_CASE("shard geometry agrees with model::ExtractShard for every ShardKind") {
  Rng rng(11);
  struct Case {
    std::vector<int64_t> shape;
    ShardKind kind;
  };
  const Case cases[] = {{{24, 8}, ShardKind::kReplicated}, {{24, 8}, ShardKind::kRows},    {{24}, ShardKind::kRows},
                        {{24, 8}, ShardKind::kCols},       {{24, 8}, ShardKind::kQkvRows}, {{24}, ShardKind::kQkvRows}};
  for (const auto& c : cases) {
    std::vector<float> global(static_cast<size_t>(Numel(c.shape)));
    for (size_t i = 0; i < global.size(); ++i) global[i] = static_cast<float>(i);  // value = global index
    for (int tp : {1, 2, 4}) {
      auto local_shape = LocalShape(c.shape, c.kind, tp);
      REQUIRE(local_shape.ok());
      for (int r = 0; r < tp; ++r) {
        std::vector<float> local(static_cast<size_t>(Numel(*local_shape)), -1.f);
        model::ExtractShard(global.data(), local.data(), c.shape, c.kind, tp, r);
        auto g = internal::MakeGeom(c.shape, c.kind, tp, r);
        REQUIRE(g.ok());
        REQUIRE(g->local_numel() == static_cast<int64_t>(local.size()));
        for (int64_t i = 0; i < g->local_numel(); ++i) {
          REQUIRE_MESSAGE(g->GlobalIndex(i) == static_cast<int64_t>(local[i]), ShardKindName(c.kind), " tp ", tp,
                          " rank ", r, " i ", i);
        }
      }
    }
  }
  CHECK(!LocalShape({10, 8}, ShardKind::kRows, 4).ok());
  CHECK(!LocalShape({10, 8}, ShardKind::kCols, 3).ok());
  CHECK(!LocalShape({24}, ShardKind::kCols, 2).ok());
  CHECK(!LocalShape({12, 4}, ShardKind::kQkvRows, 8).ok());
}

TEST_CASE("save under tp2 pp2 dp2 with ZeRO ranges, read back under tp1 and tp4, bit-exact") {
  TempDir dir;
  const Truth truth = MakeTruth(2024);
  const Layout saved{2, 2, 2};
  Status s = SaveJob(dir.path(), truth, saved, 100);
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(Exists(dir / "step-00000100/manifest.json"));
  for (int r = 0; r < 8; ++r) CHECK(Exists(dir / ("step-00000100/" + RankFileName(r))));

  for (Verify verify : {Verify::kFull, Verify::kLazy}) {
    auto c = FindLatestValid(dir.path(), verify);
    REQUIRE_MESSAGE(c.ok(), c.status().ToString());
    CHECK(c->step() == 100);
    CHECK(c->manifest().layout.world() == 8);
    CHECK(c->manifest().files.size() == 8);
    CHECK(c->metadata(5) == "{\"step\": 100, \"rank\": 5, \"rng\": [1, 2, 3]}");
    CHECK(c->kinds() == std::vector<std::string>{"exp_avg", "exp_avg_sq", "param"});
    // tp 1: whole tensors.
    CheckGlobalsEqual(*c, truth);
    // tp 4, each shard in 3 uneven ranges (a dp 3 ZeRO split), against ExtractShard.
    for (const auto& kind : Kinds()) {
      for (const auto& t : FakeModel()) {
        const auto local_shape = *LocalShape(t.shape, t.shard, 4);
        const int64_t n = Numel(local_shape);
        for (int r = 0; r < 4; ++r) {
          std::vector<float> want(static_cast<size_t>(n));
          model::ExtractShard(truth.at(kind).at(t.name).data(), want.data(), t.shape, t.shard, 4, r);
          for (int d = 0; d < 3; ++d) {
            int64_t b = n * d / 3 + (d == 1), e = n * (d + 1) / 3 + (d == 1);
            if (d == 2) e = n;
            std::vector<float> got(static_cast<size_t>(e - b), -7.f);
            ShardTarget target{t.shape, t.shard, 4, r, b, e};
            Status rs = c->Read(kind, t.name, target, got.data());
            REQUIRE_MESSAGE(rs.ok(), rs.ToString());
            CHECK_MESSAGE(std::memcmp(got.data(), want.data() + b, got.size() * sizeof(float)) == 0, kind, " ", t.name,
                          " tp rank ", r, " range ", b, "-", e);
          }
        }
      }
    }
  }

  // Mismatches are errors that name the tensor and both shapes.
  auto c = FindLatestValid(dir.path());
  REQUIRE(c.ok());
  std::vector<float> buf(4096);
  Status bad = c->Read("param", "embed.wte", ShardTarget{{41, 16}, ShardKind::kRows, 1, 0, 0, -1}, buf.data());
  CHECK(bad.code() == Code::kInvalidArgument);
  CHECK(bad.message().find("embed.wte") != std::string::npos);
  CHECK(bad.message().find("[40, 16]") != std::string::npos);
  CHECK(bad.message().find("[41, 16]") != std::string::npos);
  Status missing = c->Read("param", "layers.7.mlp.fc.weight", ShardTarget{{64, 16}}, buf.data());
  CHECK(missing.code() == Code::kNotFound);
  CHECK(missing.message().find("layers.7.mlp.fc.weight") != std::string::npos);
  CHECK(c->Read("momentum", "embed.wte", ShardTarget{{40, 16}}, buf.data()).code() == Code::kNotFound);
  CHECK(c->Read("param", "embed.wte", ShardTarget{{40, 16}, ShardKind::kRows, 2, 0, 0, 321}, buf.data()).code() ==
        Code::kInvalidArgument);
}

TEST_CASE("a tensor that no rank saved completely is an error naming it") {
  TempDir dir;
  std::vector<float> v = Values(100, 3);
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path()}, nullptr);
  REQUIRE(ck.ok());
  PieceRef whole{"a", "param", {10, 10}, ShardKind::kRows, 2, 0, 0, 50, v.data()};
  PieceRef whole1{"a", "param", {10, 10}, ShardKind::kRows, 2, 1, 0, 50, v.data() + 50};
  PieceRef part{"b", "exp_avg", {10, 10}, ShardKind::kCols, 2, 0, 0, 50, v.data()};
  PieceRef part1{"b", "exp_avg", {10, 10}, ShardKind::kCols, 2, 1, 0, 30, v.data()};  // 20 missing
  REQUIRE((*ck)->Snapshot(1, {whole, whole1, part, part1}, "{}").ok());
  REQUIRE((*ck)->Wait().ok());
  auto c = FindLatestValid(dir.path());
  REQUIRE(c.ok());
  std::vector<float> out(100);
  CHECK(c->ReadGlobal("param", "a", out.data()).ok());
  CHECK(SameBits(out, v));
  Status s = c->ReadGlobal("exp_avg", "b", out.data());
  CHECK(s.code() == Code::kDataLoss);
  CHECK(s.message().find("'b' (exp_avg)") != std::string::npos);
  CHECK(s.message().find("20 of its 100") != std::string::npos);

  // Bad pieces are refused at Snapshot, before anything is copied.
  PieceRef out_of_range{"a", "param", {10, 10}, ShardKind::kRows, 2, 0, 0, 51, v.data()};
  CHECK((*ck)->Snapshot(2, {out_of_range}, "").status().code() == Code::kInvalidArgument);
  PieceRef bad_split{"a", "param", {10, 10}, ShardKind::kRows, 3, 0, 0, 1, v.data()};
  CHECK((*ck)->Snapshot(2, {bad_split}, "").status().code() == Code::kInvalidArgument);
  PieceRef null_data{"a", "param", {10, 10}, ShardKind::kRows, 2, 0, 0, 1, nullptr};
  CHECK((*ck)->Snapshot(2, {null_data}, "").status().code() == Code::kInvalidArgument);
  CHECK((*ck)->Wait().ok());
  CHECK(!Exists(dir / "step-00000002"));
}

TEST_CASE("damaged checkpoints are detected, the older one is used, nothing good is deleted") {
  TempDir dir;
  const Truth t100 = MakeTruth(100), t200 = MakeTruth(200);
  const Layout layout{2, 1, 2};
  REQUIRE(SaveJob(dir.path(), t100, layout, 100).ok());
  REQUIRE(SaveJob(dir.path(), t200, layout, 200).ok());
  const std::string d100 = dir / "step-00000100", d200 = dir / "step-00000200";
  std::map<std::string, std::string> good;  // step 100's bytes, to prove they are untouched
  for (const auto& e : std::filesystem::directory_iterator(d100)) good[e.path().string()] = Slurp(e.path().string());
  {
    auto c = FindLatestValid(dir.path());
    REQUIRE(c.ok());
    CHECK(c->step() == 200);
  }
  auto piece_offset = [&] {
    auto c = Checkpoint::Open(d200);
    REQUIRE(c.ok());
    return c->manifest().files[1].pieces.at(0).offset;
  }();
  const std::string victim = d200 + "/" + RankFileName(1);
  const int64_t victim_size = static_cast<int64_t>(std::filesystem::file_size(victim));

  struct Damage {
    const char* name;
    std::function<void()> apply;
    const char* reason;
  };
  const Damage damages[] = {
      {"truncated file", [&] { REQUIRE(::truncate(victim.c_str(), victim_size - 100) == 0); }, "truncated file"},
      {"flipped byte", [&] { FlipByte(victim, piece_offset + 5); }, "checksum mismatch"},
      {"flipped header byte", [&] { FlipByte(victim, 9); }, "checksum mismatch"},
      {"deleted manifest", [&] { std::filesystem::remove(d200 + "/manifest.json"); }, "missing manifest"},
      {"deleted rank file", [&] { std::filesystem::remove(victim); }, "missing file"},
      {"garbled manifest",
       [&] {
         std::string m = Slurp(d200 + "/manifest.json");
         m.resize(m.size() / 2);
         REQUIRE(WriteFileAtomic(d200 + "/manifest.json", m).ok());
       },
       "unparsable manifest"},
  };
  const std::string pristine = fmt::format("{}-pristine", d200);
  std::filesystem::copy(d200, pristine);
  for (const auto& dmg : damages) {
    CAPTURE(dmg.name);
    std::filesystem::remove_all(d200);
    std::filesystem::copy(pristine, d200);
    dmg.apply();
    LogCapture log;
    auto c = FindLatestValid(dir.path());
    REQUIRE_MESSAGE(c.ok(), c.status().ToString());
    CHECK(c->step() == 100);
    CheckGlobalsEqual(*c, t100);
    std::string text = log.Text();
    CHECK_MESSAGE(text.find(dmg.reason) != std::string::npos, text);
    CHECK(text.find("step-00000200") != std::string::npos);
    CHECK(Exists(d200));  // the loader deletes nothing
    for (const auto& [path, bytes] : good) CHECK(Slurp(path) == bytes);
  }

  // Lazy verification opens a checkpoint with a flipped data byte, but the read catches it.
  std::filesystem::remove_all(d200);
  std::filesystem::copy(pristine, d200);
  FlipByte(victim, piece_offset + 5);
  {
    auto lazy = Checkpoint::Open(d200, Verify::kLazy);
    REQUIRE(lazy.ok());
    const PieceInfo& p = lazy->manifest().files[1].pieces.at(0);
    std::vector<float> out(static_cast<size_t>(Numel(p.global_shape)));
    Status s = lazy->ReadGlobal(p.kind, p.tensor, out.data());
    CHECK(s.code() == Code::kDataLoss);
    CHECK(s.message().find("checksum mismatch") != std::string::npos);
    CHECK(Checkpoint::Open(d200, Verify::kFull).status().code() == Code::kDataLoss);
  }

  // Every checkpoint damaged: NotFound listing each and why.
  std::filesystem::remove(d100 + "/manifest.json");
  auto none = FindLatestValid(dir.path());
  CHECK(none.status().code() == Code::kNotFound);
  CHECK(none.status().message().find("step-00000200: checksum mismatch") != std::string::npos);
  CHECK(none.status().message().find("step-00000100: missing manifest") != std::string::npos);
  CHECK(FindLatestValid(dir / "nothing-here").status().code() == Code::kNotFound);
}

TEST_CASE("retention keeps the newest complete checkpoints and newer incomplete ones") {
  TempDir dir;
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .keep = 2}, nullptr);
  REQUIRE(ck.ok());
  auto v = Values(1000, 5);
  REQUIRE(SaveOne(**ck, 1, v).ok());
  REQUIRE((*ck)->Wait().ok());
  REQUIRE(SaveOne(**ck, 2, v).ok());
  REQUIRE((*ck)->Wait().ok());
  // Leftovers: an interrupted step 3 (older than what comes next) and a step 90 "being written".
  REQUIRE(MakeDirs(dir / "step-00000003").ok());
  REQUIRE(WriteFileAtomic(dir / "step-00000003/rank-00000.bin", "partial").ok());
  REQUIRE(MakeDirs(dir / "step-00000090").ok());
  REQUIRE(WriteFileAtomic(dir / "step-00000090/rank-00001.bin", "in flight").ok());
  CHECK(Exists(dir / "step-00000001"));
  CHECK(Exists(dir / "step-00000003"));  // newer than the newest complete (2): kept
  REQUIRE(SaveOne(**ck, 4, v).ok());
  REQUIRE((*ck)->Wait().ok());
  CHECK(!Exists(dir / "step-00000001"));
  CHECK(Exists(dir / "step-00000002"));
  CHECK(!Exists(dir / "step-00000003"));
  REQUIRE(SaveOne(**ck, 5, v).ok());
  REQUIRE((*ck)->Wait().ok());
  std::vector<std::string> names;
  for (const auto& e : std::filesystem::directory_iterator(dir.path())) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"step-00000004", "step-00000005", "step-00000090"});
  CHECK((*ck)->CompletedSteps() == std::vector<int64_t>{1, 2, 4, 5});
  auto c = FindLatestValid(dir.path());
  REQUIRE(c.ok());
  CHECK(c->step() == 5);
  CHECK(Exists(dir / "step-00000090/rank-00001.bin"));
}

TEST_CASE("disk full: the partial step is removed, the previous checkpoint stays loadable") {
  TempDir dir;
  const std::string mnt = dir / "small";
  TmpfsMount fs(mnt, "size=1m");
  if (!fs.mounted()) {
    MESSAGE("skipped: cannot mount a 1 MiB tmpfs (", fs.error(), "); needs root");
    return;
  }
  const std::string root = mnt + "/ckpt";
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = root, .keep = 0}, nullptr);
  REQUIRE(ck.ok());
  auto small = Values(50000, 1);  // 200 KB
  auto big = Values(250000, 2);   // 1 MB: does not fit
  REQUIRE(SaveOne(**ck, 10, small).ok());
  REQUIRE((*ck)->Wait().ok());
  LogCapture log;
  REQUIRE(SaveOne(**ck, 20, big).ok());  // stage 1 is memory only
  Status s = (*ck)->Wait();
  CHECK(s.code() == Code::kIo);
  CHECK_MESSAGE(s.message().find("disk full") != std::string::npos, s.message());
  CHECK(s.message().find(root) != std::string::npos);
  CHECK((*ck)->LastError().code() == Code::kIo);
  CHECK(log.Text().find("disk full") != std::string::npos);
  CHECK(!Exists(root + "/step-00000020"));
  auto c = FindLatestValid(root);
  REQUIRE_MESSAGE(c.ok(), c.status().ToString());
  CHECK(c->step() == 10);
  std::vector<float> out(small.size());
  REQUIRE(c->ReadGlobal("param", "w", out.data()).ok());
  CHECK(SameBits(out, small));
  // The space came back: the next checkpoint succeeds.
  REQUIRE(SaveOne(**ck, 30, small).ok());
  CHECK((*ck)->Wait().ok());
  CHECK(FindLatestValid(root)->step() == 30);
  ck->reset();
}

TEST_CASE("an unwritable checkpoint directory is a clear error at construction") {
  TempDir dir;
  REQUIRE(WriteFileAtomic(dir / "a-file", "x").ok());
  auto under_file = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir / "a-file/ckpt"}, nullptr);
  CHECK(under_file.status().code() == Code::kFailedPrecondition);
  CHECK(under_file.status().message().find(dir / "a-file/ckpt") != std::string::npos);
  CHECK(AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .rank = 1}, nullptr).status().code() ==
        Code::kInvalidArgument);  // 1 rank in a world of 1

  const std::string ro = dir / "ro";
  TmpfsMount fs(ro, "size=64k", MS_RDONLY);
  if (!fs.mounted()) {
    MESSAGE("read-only part skipped: cannot mount a tmpfs (", fs.error(), ")");
    return;
  }
  auto read_only = AsyncCheckpointer::Create(CheckpointerOptions{.dir = ro}, nullptr);
  CHECK(read_only.status().code() == Code::kFailedPrecondition);
  CHECK(read_only.status().message().find("checkpoint directory " + ro + " is not writable") != std::string::npos);
  CHECK(read_only.status().message().find("Read-only") != std::string::npos);
}

TEST_CASE("overlap policy: skip drops a snapshot, wait blocks until the previous write is done") {
  auto slow = [](std::string_view stage, int64_t step) {
    if (stage == "write" && step == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  };
  auto v = Values(1000, 9);
  SUBCASE("skip") {
    TempDir dir;
    auto ck = AsyncCheckpointer::Create(
        CheckpointerOptions{.dir = dir.path(), .policy = OverlapPolicy::kSkip, .fault_hook = slow}, nullptr);
    REQUIRE(ck.ok());
    LogCapture log;
    auto a = SaveOne(**ck, 1, v);
    auto b = SaveOne(**ck, 2, v);
    REQUIRE((a.ok() && b.ok()));
    CHECK(!a->skipped);
    CHECK(b->skipped);
    CHECK(b->blocked_seconds < 0.2);
    REQUIRE((*ck)->Wait().ok());
    CHECK((*ck)->CompletedSteps() == std::vector<int64_t>{1});
    CHECK(!Exists(dir / "step-00000002"));
    std::string text = log.Text();
    CHECK_MESSAGE(text.find("checkpoint step 2 skipped: step 1 is still being written (overlap policy: skip)") !=
                      std::string::npos,
                  text);
  }
  SUBCASE("wait") {
    TempDir dir;
    auto ck = AsyncCheckpointer::Create(
        CheckpointerOptions{.dir = dir.path(), .policy = OverlapPolicy::kWait, .fault_hook = slow}, nullptr);
    REQUIRE(ck.ok());
    LogCapture log;
    auto a = SaveOne(**ck, 1, v);
    auto b = SaveOne(**ck, 2, v);
    REQUIRE((a.ok() && b.ok()));
    CHECK(a->blocked_seconds < 0.2);
    CHECK(!b->skipped);
    CHECK(b->wait_seconds > 0.1);
    CHECK(b->blocked_seconds >= b->wait_seconds);
    REQUIRE((*ck)->Wait().ok());
    CHECK((*ck)->CompletedSteps() == std::vector<int64_t>{1, 2});
    CHECK(log.Text().find("waiting for step 1 to finish writing (overlap policy: wait)") != std::string::npos);
  }
  SUBCASE("a rank that skips makes rank 0 abandon the step") {
    TempDir dir;
    InProcessCoordinator coord;
    Layout two{1, 1, 2};
    auto r0 = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .rank = 0, .layout = two}, &coord);
    auto r1 = AsyncCheckpointer::Create(
        CheckpointerOptions{
            .dir = dir.path(), .rank = 1, .layout = two, .policy = OverlapPolicy::kSkip, .fault_hook = slow},
        &coord);
    REQUIRE((r0.ok() && r1.ok()));
    REQUIRE(SaveOne(**r0, 1, v).ok());
    REQUIRE(SaveOne(**r1, 1, v).ok());
    REQUIRE(SaveOne(**r1, 2, v)->skipped);  // rank 1 still writing step 1
    REQUIRE((*r0)->Wait().ok());            // step 1 committed once rank 1 is done
    REQUIRE(SaveOne(**r0, 2, v).ok());
    Status s = (*r0)->Wait();
    CHECK(s.code() == Code::kAborted);
    CHECK(s.message().find("rank 1") != std::string::npos);
    CHECK((*r1)->Wait().ok());
    CHECK(!Exists(dir / "step-00000002/manifest.json"));
    CHECK(FindLatestValid(dir.path())->step() == 1);
  }
}

// Records the thread of each BeginStep; fails the ones in `refuse`.
class BeginRecorder final : public Coordinator {
 public:
  Status BeginStep(int64_t step) override {
    std::lock_guard<std::mutex> lock(mu_);
    begun_[step] = std::this_thread::get_id();
    if (step == refuse) return Unavailable("the store is gone");
    return Status::Ok();
  }
  Status MarkDurable(int64_t step, int rank, const FileInfo& info) override {
    return inner_.MarkDurable(step, rank, info);
  }
  Status MarkFailed(int64_t step, int rank, const Status& why) override { return inner_.MarkFailed(step, rank, why); }
  Result<std::vector<FileInfo>> WaitAllDurable(int64_t step, int world, double timeout_s) override {
    return inner_.WaitAllDurable(step, world, timeout_s);
  }
  std::optional<std::thread::id> BegunOn(int64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = begun_.find(step);
    return it == begun_.end() ? std::nullopt : std::optional(it->second);
  }
  int64_t refuse = -1;

 private:
  std::mutex mu_;
  std::map<int64_t, std::thread::id> begun_;
  InProcessCoordinator inner_;
};

TEST_CASE("a step is begun with the coordinator on the snapshotting thread; a refused begin fails the step") {
  // The store coordinator's restart check needs every rank's marks of a later checkpoint to follow this rank's
  // BeginStep: it must happen before Snapshot returns (before the next training step), not on the writer thread.
  auto hold = [](std::string_view stage, int64_t) {
    if (stage == "write") std::this_thread::sleep_for(std::chrono::milliseconds(200));
  };
  TempDir dir;
  BeginRecorder coord;
  coord.refuse = 2;
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .fault_hook = hold}, &coord);
  REQUIRE(ck.ok());
  auto v = Values(1000, 5);
  REQUIRE(SaveOne(**ck, 1, v).ok());
  CHECK(coord.BegunOn(1) == std::this_thread::get_id());  // already, while the writer sleeps at "write"
  REQUIRE((*ck)->Wait().ok());
  REQUIRE(SaveOne(**ck, 2, v).ok());
  CHECK(coord.BegunOn(2) == std::this_thread::get_id());
  Status s = (*ck)->Wait();
  CHECK(s.code() == Code::kUnavailable);
  CHECK_MESSAGE(s.message().find("the store is gone") != std::string::npos, s.ToString());
  CHECK((*ck)->CompletedSteps() == std::vector<int64_t>{1});
  CHECK(!Exists(dir / "step-00000002"));
}

TEST_CASE("a process killed while checkpointing leaves no manifest; the checkpoint is ignored and cleaned later") {
  TempDir dir;
  auto v1 = Values(20000, 1), v2 = Values(20000, 2);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    auto hang = [](std::string_view stage, int64_t step) {
      if (stage == "manifest" && step == 200) std::this_thread::sleep_for(std::chrono::seconds(60));
    };
    auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .fault_hook = hang}, nullptr);
    if (!ck.ok()) ::_exit(3);
    if (!SaveOne(**ck, 100, v1).ok() || !(*ck)->Wait().ok()) ::_exit(4);
    if (!SaveOne(**ck, 200, v2).ok()) ::_exit(5);
    std::this_thread::sleep_for(std::chrono::seconds(60));
    ::_exit(6);
  }
  const std::string rank_file = dir / "step-00000200/rank-00000.bin";
  for (int i = 0; i < 1000 && !Exists(rank_file); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(Exists(rank_file));
  REQUIRE(::kill(child, SIGKILL) == 0);
  int status = 0;
  REQUIRE(::waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(!Exists(dir / "step-00000200/manifest.json"));
  {
    LogCapture log;
    auto c = FindLatestValid(dir.path());
    REQUIRE_MESSAGE(c.ok(), c.status().ToString());
    CHECK(c->step() == 100);
    std::vector<float> out(v1.size());
    REQUIRE(c->ReadGlobal("param", "w", out.data()).ok());
    CHECK(SameBits(out, v1));
    CHECK(log.Text().find("missing manifest") != std::string::npos);
  }
  // The restarted job writes step 300; the interrupted 200 (older than it) is cleaned up.
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .keep = 2}, nullptr);
  REQUIRE(ck.ok());
  REQUIRE(SaveOne(**ck, 300, v2).ok());
  REQUIRE((*ck)->Wait().ok());
  CHECK(!Exists(dir / "step-00000200"));
  CHECK(Exists(dir / "step-00000100/manifest.json"));
  CHECK(FindLatestValid(dir.path())->step() == 300);
}

TEST_CASE("rewriting a step that already has a checkpoint replaces it consistently") {
  TempDir dir;
  auto ck = AsyncCheckpointer::Create(CheckpointerOptions{.dir = dir.path(), .reserve_bytes = 1 << 20}, nullptr);
  REQUIRE(ck.ok());
  auto a = Values(300, 1), b = Values(300, 2);
  REQUIRE(SaveOne(**ck, 7, a).ok());
  REQUIRE((*ck)->Wait().ok());
  REQUIRE(SaveOne(**ck, 7, b).ok());
  REQUIRE((*ck)->Wait().ok());
  auto c = FindLatestValid(dir.path());
  REQUIRE(c.ok());
  std::vector<float> out(b.size());
  REQUIRE(c->ReadGlobal("param", "w", out.data()).ok());
  CHECK(SameBits(out, b));
}

TEST_CASE("export writes every param as a global fp32 safetensors tensor (checked by Python)") {
  TempDir dir;
  const Truth truth = MakeTruth(77);
  REQUIRE(SaveJob(dir / "ckpt", truth, Layout{2, 2, 1}, 42).ok());
  auto c = FindLatestValid(dir / "ckpt");
  REQUIRE(c.ok());
  const std::string out = dir / "export/model.safetensors";
  Status s = ExportSafetensors(*c, out);
  REQUIRE_MESSAGE(s.ok(), s.ToString());
  CHECK(!Exists(out + ".tmp"));

  // Header: u64 length, JSON, 8-byte aligned data; sizes add up.
  std::string bytes = Slurp(out);
  REQUIRE(bytes.size() > 8);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  CHECK((8 + n) % 8 == 0);
  auto header = internal::ParseJson(std::string_view(bytes).substr(8, n));
  REQUIRE(header.ok());
  int64_t total = 0;
  for (const auto& t : FakeModel()) {
    const internal::Json* e = header->Find(t.name);
    REQUIRE_MESSAGE(e, t.name);
    CHECK(e->Find("dtype")->str == "F32");
    total += Numel(t.shape) * 4;
  }
  CHECK(static_cast<int64_t>(bytes.size()) == static_cast<int64_t>(8 + n) + total);
  CHECK(header->Find("__metadata__")->Find("step")->str == "42");

  // Expected values for the Python check: one raw file per tensor plus an index.
  const std::string expected = dir / "expected";
  REQUIRE(MakeDirs(expected).ok());
  std::string index;
  for (const auto& t : FakeModel()) {
    const auto& v = truth.at("param").at(t.name);
    REQUIRE(WriteFileAtomic(expected + "/" + t.name + ".f32",
                            std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * 4))
                .ok());
    index += fmt::format("{} {}\n", t.name, fmt::join(t.shape, " "));
  }
  REQUIRE(WriteFileAtomic(expected + "/index.txt", index).ok());
  if (!Exists("/usr/bin/python3")) {
    MESSAGE("python check skipped: /usr/bin/python3 not found");
  } else {
    int rc = std::system(
        fmt::format("/usr/bin/python3 {}/tests/checkpoint/check_safetensors.py {} {}", MS_SOURCE_DIR, out, expected)
            .c_str());
    REQUIRE(WIFEXITED(rc));
    if (WEXITSTATUS(rc) == 77) {
      MESSAGE("python check skipped: numpy not available");
    } else {
      CHECK(WEXITSTATUS(rc) == 0);
    }
  }

  // The CLI, when this build tree has it, writes the same bytes.
  const std::string cli = fmt::format("{}/megascale", MS_BINARY_DIR);
  if (Exists(cli) && std::system(fmt::format("{} export --help > /dev/null 2>&1", cli).c_str()) == 0) {
    const std::string out2 = dir / "cli.safetensors";
    int rc = std::system(fmt::format("{} export {} --output {}", cli, dir / "ckpt", out2).c_str());
    CHECK(rc == 0);
    CHECK(Slurp(out2) == bytes);
    CHECK(std::system(fmt::format("{} export {} --output {} 2>/dev/null", cli, dir / "nope", out2).c_str()) != 0);
  } else {
    MESSAGE("megascale export CLI check skipped: ", cli, " not built with the export command");
  }
}

}  // namespace
}  // namespace ms::checkpoint
