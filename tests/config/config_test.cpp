// Tests of the job spec: the shipped configs, round trips, every error class, overrides,
// derived values, data files, the bad/*.yaml fixtures and the documentation's coverage.
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/core.h"

namespace ms::config {
namespace {

namespace fs = std::filesystem;

const std::string kSourceDir = MS_SOURCE_DIR;

// A valid spec to build error cases on; line numbers matter (see the expectations).
// clang-format off
const char kBase[] =
    "name: base\n"                 // 1
    "model:\n"                     // 2
    "  layers: 4\n"                // 3
    "  hidden: 96\n"               // 4
    "  heads: 6\n"                 // 5
    "  seq_len: 60\n"              // 6
    "  vocab: 300\n"               // 7
    "  attention:\n"               // 8
    "    window: 20\n"             // 9
    "parallel:\n"                  // 10
    "  tp: 3\n"                    // 11
    "  pp: 2\n"                    // 12
    "  dp: 2\n"                    // 13
    "train:\n"                     // 14
    "  steps: 50\n"                // 15
    "  global_batch: 12\n"         // 16
    "optimizer:\n"                 // 17
    "  lr: 0.001\n"                // 18
    "  warmup_steps: 5\n"          // 19
    "data:\n"                      // 20
    "  path: data/x\n";            // 21
// clang-format on

// kBase with each `from` (which must occur) replaced by `to`, in order.
std::string Edits(const std::vector<std::pair<std::string_view, std::string_view>>& edits) {
  std::string s = kBase;
  for (const auto& [from, to] : edits) {
    size_t at = s.find(from);
    REQUIRE_MESSAGE(at != std::string::npos, from);
    s.replace(at, from.size(), to);
  }
  return s;
}
std::string Edit(std::string_view from, std::string_view to) {
  return Edits({{from, to}});
}

// Parse + ResolveAndValidate; "" when both succeed, else the error message.
std::string ErrorOf(std::string_view yaml, std::string_view source = "cfg/x.yaml") {
  auto r = ParseJobSpec(yaml, source);
  if (!r.ok()) {
    CHECK(r.status().code() == Code::kInvalidArgument);
    return r.status().message();
  }
  JobSpec spec = *r;
  Status s = ResolveAndValidate(&spec);
  if (s.ok()) return "";
  CHECK(s.code() == Code::kInvalidArgument);
  return s.message();
}

bool Has(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

#define CHECK_HAS(text, part) CHECK_MESSAGE(Has(text, part), "\n  message: ", text, "\n  missing: ", part)

// A scratch folder, removed at the end of the test.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / fmt::format("ms_config_test_{}_{}", getpid(), counter++);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  static inline int counter = 0;
};

void WriteText(const fs::path& p, std::string_view text) {
  std::ofstream out(p, std::ios::binary);
  out << text;
}

std::vector<fs::path> YamlFiles(const fs::path& dir) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() == ".yaml") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST_CASE("the base fixture is valid and derives the batch split") {
  auto r = ParseJobSpec(kBase, "cfg/x.yaml");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  JobSpec spec = *r;
  REQUIRE_MESSAGE(ResolveAndValidate(&spec).ok(), "base must be valid");
  CHECK(spec.model.ffn_hidden == 4 * 96);
  // pp > 1 and nothing given: micro_batch 1, micro_batches = global / dp.
  CHECK(spec.train.micro_batch == 1);
  CHECK(spec.parallel.micro_batches == 6);
  CHECK(spec.checkpoint.dir == "runs/default/checkpoints");
  CHECK(fs::path(spec.data.path).is_absolute());
  CHECK(spec.data.path == (fs::current_path() / "cfg/data/x").lexically_normal().string());
  CHECK(spec.marks.at("model.attention.window") == std::pair<int, int>{9, 5});
  CHECK(spec.marks.at("model") == std::pair<int, int>{2, 1});
  CHECK(KeyLocation(spec, "parallel.tp") == "cfg/x.yaml:11:3");
  CHECK(KeyLocation(spec, "parallel.zero") == "cfg/x.yaml:10:1");  // not given: its section
  CHECK(KeyLocation(spec, "log.interval") == "cfg/x.yaml");        // section not given either
}

TEST_CASE("every shipped config parses and validates (without the data files)") {
  auto files = YamlFiles(kSourceDir + "/configs");
  REQUIRE(files.size() >= 2);
  for (const auto& file : files) {
    CAPTURE(file);
    auto r = LoadJobSpec(file.string());
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    JobSpec spec = *r;
    Status s = ResolveAndValidate(&spec);
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    CHECK(spec.source == file.string());
    CHECK(spec.data.path == (fs::path(kSourceDir) / "data/fortunes").lexically_normal().string());
    // A resolved spec written out and read back is the same; resolving again changes nothing.
    auto again = ParseJobSpec(ToYaml(spec), "resolved.yaml");
    REQUIRE_MESSAGE(again.ok(), again.status().ToString(), "\n", ToYaml(spec));
    CHECK(SameSettings(*again, spec));
    JobSpec twice = spec;
    REQUIRE(ResolveAndValidate(&twice).ok());
    CHECK(twice == spec);
  }
}

TEST_CASE("tiny.yaml is the demo it claims to be") {
  auto r = LoadJobSpec(kSourceDir + "/configs/tiny.yaml");
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  JobSpec spec = *r;
  REQUIRE(ResolveAndValidate(&spec).ok());
  CHECK(spec.name == "tiny");
  CHECK(spec.model.layers == 4);
  CHECK(spec.model.hidden == 128);
  CHECK(spec.model.heads == 4);
  CHECK(spec.model.seq_len == 128);
  CHECK(spec.model.vocab == 256);
  CHECK(spec.model.block == BlockKind::kParallel);
  CHECK(spec.model.window == 64);
  CHECK(spec.train.steps == 600);
  CHECK(spec.train.global_batch == 16);
  CHECK(spec.train.seed == 1234);
  CHECK(spec.train.eval_interval == 100);
  CHECK(spec.optimizer.kind == OptimizerKind::kAdamW);
  CHECK(spec.optimizer.lr == 3e-3f);
  CHECK(spec.optimizer.min_lr == 3e-4f);
  CHECK(spec.optimizer.warmup_steps == 20);
  CHECK(spec.optimizer.schedule == ScheduleKind::kCosine);
  CHECK(spec.optimizer.weight_decay == 0.1f);
  CHECK(spec.optimizer.grad_clip == 1.0f);
  CHECK(spec.log.run_dir == "runs/tiny");
  CHECK(spec.log.interval == 10);
  CHECK(spec.parallel.dp == 2);
  CHECK(spec.train.micro_batch == 8);
  CHECK(spec.parallel.micro_batches == 1);

  auto g = LoadJobSpec(kSourceDir + "/configs/gpt2-small.yaml");
  REQUIRE_MESSAGE(g.ok(), g.status().ToString());
  CHECK(g->model.layers == 12);
  CHECK(g->model.hidden == 768);
  CHECK(g->model.heads == 12);
  CHECK(g->model.window == 0);
  CHECK(g->train.global_batch == 4);
  CHECK(g->train.steps == 10);
}

TEST_CASE("the GPU benchmark configs are what docs/PERFORMANCE.md says they are") {
  struct Want {
    const char* file;
    int layers, hidden, heads, seq_len, micro_batch, global_batch;
  };
  for (const Want w :
       {Want{"gpt2-small-gpu.yaml", 12, 768, 12, 1024, 16, 32}, Want{"gpt-1.3b-gpu.yaml", 24, 2048, 16, 2048, 4, 8}}) {
    CAPTURE(w.file);
    auto r = LoadJobSpec(kSourceDir + "/configs/" + w.file);
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    JobSpec spec = *r;
    REQUIRE(ResolveAndValidate(&spec).ok());
    CHECK(spec.model.layers == w.layers);
    CHECK(spec.model.hidden == w.hidden);
    CHECK(spec.model.heads == w.heads);
    CHECK(spec.model.seq_len == w.seq_len);
    CHECK(spec.model.vocab == 50257);  // GPT-2's vocabulary ...
    CHECK(spec.model.vocab_pad_to == 128);
    CHECK(spec.model.padded_vocab() == 50304);  // ... padded to a multiple of 128, the padding out of the loss
    CHECK(spec.model.window == 0);
    CHECK(spec.train.micro_batch == w.micro_batch);
    CHECK(spec.train.global_batch == w.global_batch);
    CHECK(spec.parallel.micro_batches == 2);
    CHECK(spec.train.precision == Precision::kBf16);
    CHECK(spec.runtime.backend == Backend::kCuda);
  }
  auto g = LoadJobSpec(kSourceDir + "/configs/gpt2-small-gpu.yaml");
  REQUIRE(g.ok());
  CHECK(g->train.micro_batch * g->model.seq_len >= 16384);  // >= 16 K tokens per micro-batch
}

// Random settings (in range, odd values, strings that YAML would misread unquoted) survive
// ToYaml -> ParseJobSpec exactly.
TEST_CASE("round trip of random specs through ToYaml") {
  Rng rng(20240611, 7);
  const std::vector<std::string> strings = {
      "",      "yes",    "null", "123",    "a: b", "# not a comment", "x\"y",     "back\\slash", "tab\t", "new\nline",
      " lead", "trail ", "~",    "[1, 2]", "{a}",  "caf\xc3\xa9",     "\x01\x7f", "-",           "*alias"};
  auto pick = [&](const std::vector<std::string>& v) { return v[rng.NextBelow(v.size())]; };
  auto small = [&](int lo, int n) { return lo + static_cast<int>(rng.NextBelow(n)); };
  // Odd floats: random mantissa, random decade.
  auto real = [&](double lo_exp, double hi_exp) {
    return static_cast<float>(rng.NextDouble() * std::pow(10.0, lo_exp + rng.NextDouble() * (hi_exp - lo_exp)));
  };
  for (int trial = 0; trial < 200; ++trial) {
    JobSpec s;
    s.name = pick(strings) + "n";  // name must not be empty
    s.model.layers = small(1, 97);
    s.model.hidden = small(1, 5000);
    s.model.heads = small(1, 33);
    s.model.ffn_hidden = small(0, 20000);
    s.model.vocab = small(1, 70000);
    s.model.seq_len = small(1, 4097);
    s.model.block = static_cast<BlockKind>(rng.NextBelow(2));
    s.model.window = small(0, 5000);
    s.model.norm_eps = std::max(real(-12, -2), 1e-30f);
    s.model.tied_embeddings = rng.NextBelow(2);
    s.model.init_std = std::max(real(-4, 0), 1e-30f);
    s.parallel = {small(1, 9),           small(1, 9), small(1, 65), small(0, 64),
                  rng.NextBelow(2) == 1, small(1, 4), small(0, 3)};
    s.train.steps = int64_t{1} + static_cast<int64_t>(rng.NextBelow(uint64_t{1} << 40));
    s.train.global_batch = small(1, 4096);
    s.train.micro_batch = small(0, 64);
    s.train.seed = rng.NextU64();
    s.train.precision = static_cast<Precision>(rng.NextBelow(2));
    s.train.eval_interval = small(0, 1000);
    s.train.eval_batches = small(1, 100);
    s.optimizer.kind = static_cast<OptimizerKind>(rng.NextBelow(2));
    s.optimizer.lr = std::max(real(-7, 0), 1e-30f);
    s.optimizer.min_lr = real(-8, -1);
    s.optimizer.warmup_steps = small(0, 100000);
    s.optimizer.schedule = static_cast<ScheduleKind>(rng.NextBelow(2));
    s.optimizer.weight_decay = real(-3, 0);
    s.optimizer.beta1 = static_cast<float>(rng.NextDouble() * 0.999);
    s.optimizer.beta2 = static_cast<float>(rng.NextDouble() * 0.999);
    s.optimizer.eps = std::max(real(-12, -4), 1e-30f);
    s.optimizer.grad_clip = real(-1, 1);
    s.data.path = pick(strings);
    s.data.tokenizer = pick(strings) + "t";
    s.data.valid_fraction = rng.NextDouble() * 0.5;
    s.checkpoint.dir = pick(strings);
    s.checkpoint.interval = small(0, 10000);
    s.checkpoint.keep = small(1, 10);
    s.checkpoint.resume = rng.NextBelow(2) ? "auto" : "none";
    s.runtime.backend = static_cast<Backend>(rng.NextBelow(3));
    s.runtime.threads = small(0, 256);
    s.runtime.redis = pick(strings);
    s.log.run_dir = pick(strings) + "/r";
    s.log.interval = small(1, 100);
    s.log.peak_flops = rng.NextDouble() * 1e15;
    s.log.trace = rng.NextBelow(2);
    std::string yaml = ToYaml(s);
    auto back = ParseJobSpec(yaml, "roundtrip.yaml");
    REQUIRE_MESSAGE(back.ok(), back.status().ToString(), "\n", yaml);
    CHECK_MESSAGE(SameSettings(*back, s), yaml);
    CHECK(ToYaml(*back).substr(ToYaml(*back).find('\n')) == yaml.substr(yaml.find('\n')));
  }
}

TEST_CASE("ToYaml writes every key, defaults included") {
  JobSpec def;
  std::string yaml = ToYaml(def);
  for (const std::string& key : AllKeys()) {
    std::string leaf = key.substr(key.rfind('.') + 1);
    CHECK_MESSAGE(Has(yaml, leaf + ":"), key);
  }
  auto back = ParseJobSpec(yaml, "defaults.yaml");
  REQUIRE(back.ok());
  CHECK(SameSettings(*back, def));
  // Every key was in the text, so every key has a mark.
  for (const std::string& key : AllKeys()) CHECK_MESSAGE(back->marks.count(key) == 1, key);
}

TEST_CASE("type errors name file:line:col, key, expected, found and an example") {
  std::string m = ErrorOf(Edit("heads: 6", "heads: twelve"));
  CHECK_HAS(m, "cfg/x.yaml:5:10: model.heads: expected a positive integer, found \"twelve\"");
  CHECK_HAS(m, "for example heads: 4");

  m = ErrorOf(Edit("layers: 4", "layers: -2"));
  CHECK_HAS(m, "cfg/x.yaml:3:11: model.layers: expected a positive integer, found \"-2\"");

  m = ErrorOf(Edit("steps: 50", "steps: 2.5"));
  CHECK_HAS(m, "cfg/x.yaml:15:10: train.steps: expected a positive integer, found \"2.5\"");

  m = ErrorOf(Edit("hidden: 96", "hidden: 99999999999"));
  CHECK_HAS(m, "cfg/x.yaml:4:11: model.hidden: expected a positive integer, found \"99999999999\"");

  m = ErrorOf(Edit("heads: 6", "heads: [1, 2]"));
  CHECK_HAS(m, "cfg/x.yaml:5:10: model.heads: expected a positive integer, found a list");

  m = ErrorOf(Edit("heads: 6", "heads:"));
  CHECK_HAS(m, "cfg/x.yaml:5:3: model.heads: expected a positive integer, found nothing");

  m = ErrorOf(Edit("lr: 0.001", "lr: fast"));
  CHECK_HAS(m, "cfg/x.yaml:18:7: optimizer.lr: expected a positive number, found \"fast\"; for example lr: 0.0003");

  m = ErrorOf(Edit("lr: 0.001", "lr: 1e999"));  // not finite
  CHECK_HAS(m, "cfg/x.yaml:18:7: optimizer.lr: expected a positive number");

  m = ErrorOf(std::string(kBase) + "log:\n  trace: maybe\n");
  CHECK_HAS(m, "cfg/x.yaml:23:10: log.trace: expected true or false, found \"maybe\"");

  m = ErrorOf(Edit("data:\n  path: data/x\n", "data:\n  path: [a, b]\n"));
  CHECK_HAS(m, "cfg/x.yaml:21:9: data.path: expected a string, found a list");

  // Accepted spellings: whole numbers in exponent form, yes/no, upper-case enum values.
  CHECK(ErrorOf(Edit("steps: 50", "steps: 5e1")) == "");
  CHECK(ErrorOf(Edit("steps: 50", "steps: +50")) == "");
  CHECK(ErrorOf(std::string(kBase) + "log:\n  trace: yes\nruntime:\n  backend: CPU\n") == "");
}

TEST_CASE("out-of-range single values") {
  struct Case {
    std::string section;  // one section, placed at line 2 (its key at line 3)
    std::string expect;
  };
  const std::vector<Case> cases = {
      {"optimizer:\n  beta2: 1.0\n", "cfg/x.yaml:3:10: optimizer.beta2: expected a number in [0, 1), found \"1.0\""},
      {"optimizer:\n  beta1: -0.1\n", "cfg/x.yaml:3:10: optimizer.beta1: expected a number in [0, 1), found \"-0.1\""},
      {"optimizer:\n  eps: 0\n", "cfg/x.yaml:3:8: optimizer.eps: expected a positive number, found \"0\""},
      {"optimizer:\n  lr: 0\n", "cfg/x.yaml:3:7: optimizer.lr: expected a positive number, found \"0\""},
      {"optimizer:\n  min_lr: -1e-5\n", "cfg/x.yaml:3:11: optimizer.min_lr: expected a non-negative number"},
      {"optimizer:\n  weight_decay: nan\n", "optimizer.weight_decay: expected a non-negative number, found \"nan\""},
      {"train:\n  steps: 0\n", "cfg/x.yaml:3:10: train.steps: expected a positive integer, found \"0\""},
      {"train:\n  seed: -1\n", "train.seed: expected a non-negative integer, found \"-1\""},
      {"parallel:\n  zero: 3\n", "cfg/x.yaml:3:9: parallel.zero: expected an integer in [0, 2], found \"3\""},
      {"parallel:\n  tp: 0\n",
       "cfg/x.yaml:3:7: parallel.tp: expected a positive integer, found \"0\"; for example tp: 1"},
      {"data:\n  valid_fraction: 0.6\n  path: d\n",
       "cfg/x.yaml:3:19: data.valid_fraction: expected a number in [0, 0.5], found \"0.6\""},
      {"checkpoint:\n  keep: 0\n",
       "cfg/x.yaml:3:9: checkpoint.keep: expected a positive integer, found \"0\"; for "
       "example keep: 3"},
      {"checkpoint:\n  resume: latest\n",
       "cfg/x.yaml:3:11: checkpoint.resume: expected one of \"none\", \"auto\", found \"latest\""},
      {"model:\n  norm: rmsnorm\n", "cfg/x.yaml:3:9: model.norm: expected one of \"layernorm\", found \"rmsnorm\""},
      {"model:\n  window: 8\n",
       "cfg/x.yaml:3:3: unknown key \"window\" in model (did you mean model.attention.window?"},
      {"log:\n  interval: 0\n", "cfg/x.yaml:3:13: log.interval: expected a positive integer, found \"0\""},
      {"runtime:\n  threads: -4\n", "cfg/x.yaml:3:12: runtime.threads: expected a non-negative integer"},
      {"runtime:\n  bf16_operands: fast\n",
       "cfg/x.yaml:3:18: runtime.bf16_operands: expected one of \"keep\", \"cast\", \"cublas\", found \"fast\""},
      {"name: \"\"\n", "cfg/x.yaml:2:7: name: expected a non-empty string, found \"\""},
  };
  for (const auto& c : cases) {
    std::string yaml = "# spec\n" + c.section;
    if (c.section.rfind("data:", 0) != 0) yaml += "data:\n  path: d\n";
    CAPTURE(yaml);
    CHECK_HAS(ErrorOf(yaml), c.expect);
    CHECK(ErrorOf(yaml.substr(0, yaml.find('\n') + 1) + "data:\n  path: d\n") == "");  // the rest is valid
  }
}

TEST_CASE("unknown keys get a did-you-mean, a right section, or the list of keys") {
  std::string m = ErrorOf(Edit("hidden: 96", "hiden: 96"));
  CHECK_HAS(m, "cfg/x.yaml:4:3: unknown key \"hiden\" in model (did you mean \"hidden\"?)");

  m = ErrorOf(Edit("model:", "modle:"));
  CHECK_HAS(m, "cfg/x.yaml:2:1: unknown top-level key \"modle\" (did you mean \"model\"?)");

  m = ErrorOf(Edit("window: 20", "widow: 20"));
  CHECK_HAS(m, "cfg/x.yaml:9:5: unknown key \"widow\" in model.attention (did you mean \"window\"?)");

  m = ErrorOf(Edit("hidden: 96", "lr: 96"));
  CHECK_HAS(m, "cfg/x.yaml:4:3: unknown key \"lr\" in model (did you mean optimizer.lr?");

  m = ErrorOf(Edit("hidden: 96", "flux_capacitor: 96"));
  CHECK_HAS(m, "cfg/x.yaml:4:3: unknown key \"flux_capacitor\" in model; valid keys in model: layers, hidden, heads");

  m = ErrorOf(std::string("layers: 4\n") + kBase);
  CHECK_HAS(m, "cfg/x.yaml:1:1: unknown top-level key \"layers\" (did you mean model.layers?");

  // Keys are case-sensitive, but the suggestion finds them.
  m = ErrorOf(Edit("hidden: 96", "Hidden: 96"));
  CHECK_HAS(m, "(did you mean \"hidden\"?)");
}

TEST_CASE("enum values: did-you-mean, list, case-insensitive") {
  std::string m = ErrorOf(Edit("window: 20", "window: 20\n  block: paralel"));
  CHECK_HAS(m,
            "cfg/x.yaml:10:10: model.block: expected one of \"parallel\", \"sequential\", found \"paralel\" "
            "(did you mean \"parallel\"?)");
  m = ErrorOf(Edit("lr: 0.001", "lr: 0.001\n  kind: sgd"));
  CHECK_HAS(m, "cfg/x.yaml:19:9: optimizer.kind: expected one of \"adamw\", \"lamb\", found \"sgd\"");
  m = ErrorOf(std::string(kBase) + "runtime:\n  backend: cude\n");
  CHECK_HAS(m,
            "cfg/x.yaml:23:12: runtime.backend: expected one of \"cpu\", \"cuda\", \"auto\", found \"cude\" "
            "(did you mean \"cuda\"?)");

  auto r = ParseJobSpec(Edit("lr: 0.001", "lr: 0.001\n  kind: LAMB\n  schedule: Constant"), "x");
  REQUIRE(r.ok());
  CHECK(r->optimizer.kind == OptimizerKind::kLamb);
  CHECK(r->optimizer.schedule == ScheduleKind::kConstant);
  CHECK(Name(BlockKind::kSequential) == "sequential");
  CHECK(Name(OptimizerKind::kLamb) == "lamb");
  CHECK(Name(ScheduleKind::kConstant) == "constant");
  CHECK(Name(Backend::kAuto) == "auto");
  CHECK(Name(Precision::kBf16) == "bf16");
}

TEST_CASE("document structure errors") {
  std::string m = ErrorOf("model:\n  layers: 4\n   heads: 2\n");
  CHECK_HAS(m, "cfg/x.yaml:3:");
  CHECK_HAS(m, "YAML syntax error: ");
  CHECK_HAS(m, "check the indentation");

  m = ErrorOf("model: {layers: 4\n");
  CHECK_HAS(m, "cfg/x.yaml:");
  CHECK_HAS(m, "YAML syntax error");

  m = ErrorOf("- model\n- train\n");
  CHECK_HAS(m, "cfg/x.yaml:1:1: expected the job spec to be a map of sections");
  CHECK_HAS(m, "found a list");

  m = ErrorOf("just words\n");
  CHECK_HAS(m, "expected the job spec to be a map of sections (\"model:\", \"train:\", ...), found \"just words\"");

  CHECK_HAS(ErrorOf(""), "cfg/x.yaml: the job spec is empty");
  CHECK_HAS(ErrorOf("# only a comment\n\n"), "cfg/x.yaml: the job spec is empty");

  m = ErrorOf(std::string(kBase) + "---\nname: other\n");
  CHECK_HAS(m, "found 2 YAML documents");
  CHECK_HAS(m, "remove the \"---\" separator");

  m = ErrorOf(Edit("heads: 6", "heads: 6\n  heads: 3"));
  CHECK_HAS(m, "cfg/x.yaml:6:3: model.heads: duplicate key (first given at line 5); remove one of them");
  m = ErrorOf(std::string(kBase) + "model:\n  layers: 2\n");
  CHECK_HAS(m, "cfg/x.yaml:22:1: model: duplicate key (first given at line 2)");

  m = ErrorOf(Edit("model:\n  layers: 4\n", "model: 4\nx:\n  layers: 4\n"));
  CHECK_HAS(m, "cfg/x.yaml:2:8: model: expected a map of settings");
  CHECK_HAS(m, "for example model: {layers: 4}");

  m = ErrorOf(Edit("    window: 20", "    - 20"));
  CHECK_HAS(m, "cfg/x.yaml:9:5: model.attention: expected a map of settings");
  CHECK_HAS(m, "found a list; for example attention: {window: 0}");

  m = ErrorOf(Edit("model:", "[a]: 1\nmodel:"));
  CHECK_HAS(m, "cfg/x.yaml:2:1: job spec: expected a key name, found a list");

  // An empty section means all defaults; so does a missing one.
  CHECK(ErrorOf(std::string(kBase) + "log:\nruntime:\n") == "");
}

TEST_CASE("cross-field rules name the values and point at the responsible key") {
  struct Case {
    std::vector<std::pair<std::string_view, std::string_view>> edits;
    std::string expect;  // "" = valid
  };
  const std::vector<Case> cases = {
      {{{"tp: 3", "tp: 4"}},
       "cfg/x.yaml:11:3: parallel.tp: model.heads = 6 is not divisible by parallel.tp = 4 (each tensor-parallel rank "
       "holds heads / tp whole heads); use tp in {1, 2, 3, 6}"},
      {{{"heads: 6", "heads: 5"}},
       "cfg/x.yaml:5:3: model.heads: model.hidden = 96 is not divisible by model.heads = 5 (head dim = hidden / heads "
       "must be whole); use heads: 4, a divisor of 96"},
      {{{"layers: 4", "layers: 5"}},
       "cfg/x.yaml:12:3: parallel.pp: model.layers = 5 is not divisible by parallel.pp * parallel.virtual_stages = "
       "2 * 1 = 2"},
      {{{"vocab: 300", "vocab: 301"}},
       "cfg/x.yaml:7:3: model.vocab: model.vocab = 301 is not divisible by parallel.tp = 3 (the vocabulary is split "
       "across tensor-parallel ranks); pad it with model.vocab_pad_to: 384 (the padding stays out of the loss) or use "
       "vocab: 303"},
      {{{"  vocab: 300", "  vocab: 301\n  vocab_pad_to: 384"}}, ""},
      {{{"  vocab: 300", "  vocab: 301\n  vocab_pad_to: 128"}}, ""},  // 384 rows: 128 per rank
      {{{"  vocab: 300", "  vocab: 301\n  vocab_pad_to: 100"}},
       "cfg/x.yaml:8:3: model.vocab_pad_to: model.vocab = 301 padded to a multiple of model.vocab_pad_to = 100 gives "
       "400 rows, not divisible by parallel.tp = 3 (the vocabulary is split across tensor-parallel ranks); set "
       "vocab_pad_to: 384"},
      {{{"  vocab: 300", "  vocab: 300\n  ffn_hidden: 100"}},
       "cfg/x.yaml:8:3: model.ffn_hidden: model.ffn_hidden = 100 is not divisible by parallel.tp = 3 (the MLP is "
       "split by columns across tensor-parallel ranks); use ffn_hidden: 99 or 102"},
      {{{"window: 20", "window: 61"}},
       "cfg/x.yaml:9:5: model.attention.window: model.attention.window = 61 is larger than model.seq_len = 60; use a "
       "window in [0, 60] "
       "(0 = full causal attention)"},
      {{{"window: 20", "window: 60"}}, ""},
      // Sequence parallelism needs seq_len % tp == 0; without it any seq_len goes.
      {{{"seq_len: 60", "seq_len: 62"}}, ""},
      {{{"seq_len: 60", "seq_len: 62"}, {"dp: 2", "dp: 2\n  sequence_parallel: true"}},
       "cfg/x.yaml:6:3: model.seq_len: model.seq_len = 62 is not divisible by parallel.tp = 3, which "
       "sequence_parallel needs (each tensor-parallel rank holds seq_len / tp positions); use seq_len: 60 or 63, or "
       "sequence_parallel: false"},
      {{{"dp: 2", "dp: 2\n  sequence_parallel: true"}}, ""},
      {{{"tp: 3", "tp: 1\n  sequence_parallel: true"}, {"seq_len: 60", "seq_len: 61"}}, ""},  // no-op at tp 1
      // ZeRO at dp 1 is a no-op, allowed.
      {{{"dp: 2", "dp: 1\n  zero: 2"}}, ""},
      // Pipeline chunks.
      {{{"dp: 2", "dp: 2\n  virtual_stages: 2"}}, ""},  // 4 layers = 2 stages * 2 chunks
      {{{"dp: 2", "dp: 2\n  virtual_stages: 4"}},
       "cfg/x.yaml:14:3: parallel.virtual_stages: model.layers = 4 is not divisible by parallel.pp * "
       "parallel.virtual_stages = 2 * 4 = 8 (each pipeline stage holds an equal number of whole layers); use "
       "layers: 8, or pp * virtual_stages in {1, 2, 4}"},
      {{{"pp: 2", "pp: 1\n  virtual_stages: 2"}},
       "cfg/x.yaml:13:3: parallel.virtual_stages: virtual_stages = 2 needs pipeline parallelism, but parallel.pp = 1; "
       "set pp > 1 or virtual_stages: 1"},
      {{{"dp: 2", "dp: 2\n  virtual_stages: 2\n  micro_batches: 3"}},
       "cfg/x.yaml:15:3: parallel.micro_batches: parallel.micro_batches = 3 is not a multiple of parallel.pp = 2, "
       "which the interleaved schedule (virtual_stages = 2) needs; use micro_batches: 2 or 4"},
      // Batch arithmetic.
      {{{"global_batch: 12", "global_batch: 13"}},
       "cfg/x.yaml:16:3: train.global_batch: train.global_batch = 13 is not divisible by parallel.dp = 2 (every "
       "data-parallel rank takes global_batch / dp sequences); use global_batch: 12 or 14"},
      {{{"global_batch: 12", "global_batch: 12\n  micro_batch: 4"}},
       "cfg/x.yaml:17:3: train.micro_batch: train.global_batch / parallel.dp = 12 / 2 = 6 sequences per "
       "data-parallel rank cannot be split into micro-batches of train.micro_batch = 4; use micro_batch in "
       "{1, 2, 3, 6}"},
      {{{"dp: 2", "dp: 2\n  micro_batches: 4"}},
       "cfg/x.yaml:14:3: parallel.micro_batches: train.global_batch / parallel.dp = 12 / 2 = 6 sequences per "
       "data-parallel rank cannot be split into parallel.micro_batches = 4 equal micro-batches; use micro_batches in "
       "{1, 2, 3, 6}"},
      {{{"dp: 2", "dp: 2\n  micro_batches: 2"}, {"global_batch: 12", "global_batch: 12\n  micro_batch: 2"}},
       "cfg/x.yaml:18:3: train.micro_batch: train.global_batch = 12 but train.micro_batch * parallel.micro_batches "
       "* parallel.dp = 2 * 2 * 2 = 8; make them equal, or set micro_batch (or micro_batches) to 0 to derive it"},
      {{{"dp: 2", "dp: 2\n  micro_batches: 3"}, {"global_batch: 12", "global_batch: 12\n  micro_batch: 2"}}, ""},
      // Optimizer.
      {{{"lr: 0.001", "lr: 0.001\n  min_lr: 0.01"}},
       "cfg/x.yaml:19:3: optimizer.min_lr: optimizer.min_lr = 0.01 is larger than optimizer.lr = 0.001; use a min_lr "
       "in "
       "[0, 0.001]"},
      {{{"lr: 0.001", "lr: 0.001\n  min_lr: 0.001"}}, ""},
      {{{"warmup_steps: 5", "warmup_steps: 51"}},
       "cfg/x.yaml:19:3: optimizer.warmup_steps: optimizer.warmup_steps = 51 is longer than train.steps = 50; use "
       "warmup_steps <= 50"},
      {{{"warmup_steps: 5", "warmup_steps: 50"}}, ""},
      // Precision and backend.
      {{{"steps: 50", "steps: 50\n  precision: bf16"}},
       "cfg/x.yaml:16:3: train.precision: bf16 needs the cuda backend; use precision: fp32"},
      {{{"steps: 50", "steps: 50\n  precision: bf16"}, {"name: base", "runtime: {backend: cuda}"}}, ""},
      {{{"steps: 50", "steps: 50\n  precision: bf16"}, {"name: base", "runtime: {backend: auto}"}}, ""},
      // bf16 activations need bf16 GEMMs on bf16 operands and the fused kernels.
      {{{"name: base", "runtime: {activations: bf16}"}},
       "cfg/x.yaml:1:11: runtime.activations: bf16 activations need bf16 GEMMs on bf16 operands"},
      {{{"steps: 50", "steps: 50\n  precision: bf16"},
        {"name: base", "runtime: {backend: cuda, activations: bf16, bf16_operands: cublas}"}},
       "runtime.activations: bf16 activations need"},
      {{{"steps: 50", "steps: 50\n  precision: bf16"},
        {"name: base", "runtime: {backend: cuda, activations: bf16, fused_kernels: false}"}},
       "runtime.activations: bf16 activations need"},
      {{{"steps: 50", "steps: 50\n  precision: bf16"}, {"name: base", "runtime: {backend: cuda, activations: bf16}"}},
       ""},
      // cuDNN's attention reads bf16 activations; an unknown value is named.
      {{{"steps: 50", "steps: 50\n  precision: bf16"},
        {"name: base", "runtime: {backend: cuda, activations: bf16, attention_kernels: cudnn}"}},
       ""},
      {{{"steps: 50", "steps: 50\n  precision: bf16"},
        {"name: base", "runtime: {backend: cuda, attention_kernels: cudnn}"}},
       "runtime.attention_kernels: runtime.attention_kernels: cudnn runs the attention of bf16 activations"},
      {{{"name: base", "runtime: {attention_kernels: flash}"}}, "runtime.attention_kernels"},
      // Evaluation needs held-out data.
      {{{"steps: 50", "steps: 50\n  eval_interval: 10"}}, ""},
      {{{"steps: 50", "steps: 50\n  eval_interval: 10"}, {"path: data/x", "path: data/x\n  valid_fraction: 0"}},
       "cfg/x.yaml:16:3: train.eval_interval: evaluation every 10 steps needs a validation split, but "
       "data.valid_fraction = 0; set data.valid_fraction: 0.05, or eval_interval: 0"},
      // Dataset.
      {{{"path: data/x", "path: \"\""}},
       "cfg/x.yaml:21:3: data.path: expected the path prefix of the token dataset (<path>.bin and <path>.idx), "
       "found nothing; add data: {path: ../data/fortunes}"},
      {{{"data:\n  path: data/x\n", ""}},
       "cfg/x.yaml: data.path: expected the path prefix of the token dataset (<path>.bin and <path>.idx), found "
       "nothing; add data: {path: ../data/fortunes} (make it with scripts/make_demo_data.sh)"},
  };
  for (const auto& c : cases) {
    std::string yaml = Edits(c.edits);
    CAPTURE(yaml);
    std::string m = ErrorOf(yaml);
    if (c.expect.empty()) {
      CHECK_MESSAGE(m.empty(), m);
    } else {
      CHECK_HAS(m, c.expect);
    }
  }
}

TEST_CASE("ResolveAndValidate checks ranges of programmatic values too and is idempotent") {
  auto r = ParseJobSpec(kBase, "cfg/x.yaml");
  REQUIRE(r.ok());
  JobSpec spec = *r;
  spec.optimizer.lr = -1;
  Status s = ResolveAndValidate(&spec);
  REQUIRE_FALSE(s.ok());
  CHECK_HAS(s.message(), "cfg/x.yaml:18:3: optimizer.lr: expected a positive number, found \"-1\"");
  spec = *r;
  spec.optimizer.beta1 = 1.0f;
  s = ResolveAndValidate(&spec);
  CHECK_HAS(s.message(), "cfg/x.yaml:17:1: optimizer.beta1: expected a number in [0, 1), found \"1\"");
  spec = *r;
  spec.model.norm = "rmsnorm";
  CHECK_HAS(ResolveAndValidate(&spec).message(), "model.norm: expected one of \"layernorm\", found \"rmsnorm\"");

  spec = *r;
  REQUIRE(ResolveAndValidate(&spec).ok());
  JobSpec again = spec;
  REQUIRE(ResolveAndValidate(&again).ok());
  CHECK(again == spec);
}

TEST_CASE("batch arithmetic: random layouts keep global == micro_batch * micro_batches * dp") {
  Rng rng(99, 1);
  int ok_count = 0;
  for (int trial = 0; trial < 400; ++trial) {
    JobSpec spec;
    spec.data.path = "/d/x";
    spec.model.layers = 12;
    spec.parallel.dp = 1 + static_cast<int>(rng.NextBelow(6));
    spec.parallel.pp = 1 + static_cast<int>(rng.NextBelow(3));
    spec.parallel.micro_batches = static_cast<int>(rng.NextBelow(5));
    spec.train.micro_batch = static_cast<int>(rng.NextBelow(5));
    spec.train.global_batch = 1 + static_cast<int>(rng.NextBelow(40));
    const int g = spec.train.global_batch, dp = spec.parallel.dp, m0 = spec.parallel.micro_batches,
              b0 = spec.train.micro_batch;
    // Independent oracle: valid iff some (b, m) matching the given non-zero values has b * m * dp == g.
    bool expect_ok = false;
    for (int b = 1; b <= g && !expect_ok; ++b) {
      for (int m = 1; m <= g && !expect_ok; ++m) {
        if ((b0 == 0 || b == b0) && (m0 == 0 || m == m0) && b * m * dp == g) expect_ok = true;
      }
    }
    Status s = ResolveAndValidate(&spec);
    CAPTURE(g);
    CAPTURE(dp);
    CAPTURE(m0);
    CAPTURE(b0);
    CHECK_MESSAGE(s.ok() == expect_ok, s.ToString());
    if (s.ok()) {
      ++ok_count;
      CHECK(int64_t{spec.train.micro_batch} * spec.parallel.micro_batches * dp == g);
      if (b0) CHECK(spec.train.micro_batch == b0);
      if (m0) CHECK(spec.parallel.micro_batches == m0);
      if (!b0 && !m0) CHECK(spec.parallel.micro_batches == (spec.parallel.pp == 1 ? 1 : g / dp));
    } else {
      CHECK_HAS(s.message(), "global_batch");
    }
  }
  CHECK(ok_count > 30);
  CHECK(ok_count < 400);
}

TEST_CASE("overrides: dotted keys, types, errors located at --set") {
  auto r = ParseJobSpec(kBase, "cfg/x.yaml");
  REQUIRE(r.ok());
  JobSpec spec = *r;
  REQUIRE(ApplyOverride(&spec, "train.steps=10").ok());
  REQUIRE(ApplyOverride(&spec, "model.attention.window=64").ok());
  REQUIRE(ApplyOverride(&spec, " optimizer.lr = 2.5e-4 ").ok());
  REQUIRE(ApplyOverride(&spec, "name='my job'").ok());
  REQUIRE(ApplyOverride(&spec, "runtime.redis=").ok());
  REQUIRE(ApplyOverride(&spec, "runtime.backend=AUTO").ok());
  REQUIRE(ApplyOverride(&spec, "log.trace=true").ok());
  REQUIRE(ApplyOverride(&spec, "train.seed=18446744073709551615").ok());
  REQUIRE(ApplyOverride(&spec, "log.run_dir=\"runs/a=b\"").ok());
  CHECK(spec.train.steps == 10);
  CHECK(spec.model.window == 64);
  CHECK(spec.optimizer.lr == 2.5e-4f);
  CHECK(spec.name == "my job");
  CHECK(spec.runtime.redis.empty());
  CHECK(spec.runtime.backend == Backend::kAuto);
  CHECK(spec.log.trace);
  CHECK(spec.train.seed == 18446744073709551615ull);
  CHECK(spec.log.run_dir == "runs/a=b");
  CHECK(KeyLocation(spec, "train.steps") == "--set train.steps=10");
  CHECK(KeyLocation(spec, "model.heads") == "cfg/x.yaml:5:3");
  // The override is written into ToYaml as a comment and the value itself.
  std::string yaml = ToYaml(spec);
  CHECK_HAS(yaml, "# --set train.steps=10\n");
  CHECK_HAS(yaml, "  steps: 10\n");

  JobSpec w = *r;
  Status s = ApplyOverride(&w, "model.heads=twelve");
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_HAS(s.message(),
            "--set model.heads=twelve: model.heads: expected a positive integer, found \"twelve\"; "
            "for example --set model.heads=4");
  CHECK_HAS(ApplyOverride(&w, "model.hiden=3").message(),
            "--set model.hiden=3: unknown key \"hiden\" in model (did you mean \"hidden\"?)");
  CHECK_HAS(ApplyOverride(&w, "modle.hidden=3").message(),
            "--set modle.hidden=3: unknown top-level key \"modle\" (did you mean \"model\"?)");
  CHECK_HAS(ApplyOverride(&w, "model.window=3").message(),
            "unknown key \"window\" in model (did you mean model.attention.window?");
  CHECK_HAS(ApplyOverride(&w, "model=3").message(),
            "--set model=3: model is a section, not a value; set one of its keys, e.g. --set model.layers=4");
  CHECK_HAS(ApplyOverride(&w, "train.steps.x=3").message(),
            "--set train.steps.x=3: train.steps is a value, not a section");
  CHECK_HAS(ApplyOverride(&w, "train.steps").message(),
            "--set train.steps: expected key=value, found no \"=\"; for example --set train.steps=10");
  CHECK_HAS(ApplyOverride(&w, "=4").message(), "expected key=value, found an empty key");
  CHECK_HAS(ApplyOverride(&w, "train.steps=").message(),
            "--set train.steps=: train.steps: expected a positive integer, found nothing");
  CHECK_HAS(ApplyOverride(&w, "model.block=sequentail").message(),
            "model.block: expected one of \"parallel\", \"sequential\", found \"sequentail\" (did you mean "
            "\"sequential\"?)");
  CHECK(SameSettings(w, *r));  // failed overrides change nothing
  CHECK(w.overrides.empty());

  // A cross-field error caused by an override points at the override.
  JobSpec x = *r;
  REQUIRE(ApplyOverride(&x, "parallel.tp=4").ok());
  s = ResolveAndValidate(&x);
  CHECK_HAS(s.message(), "--set parallel.tp=4: parallel.tp: model.heads = 6 is not divisible by parallel.tp = 4");
  x = *r;
  REQUIRE(ApplyOverride(&x, "train.steps=3").ok());
  CHECK_HAS(ResolveAndValidate(&x).message(),
            "--set train.steps=3: train.steps: optimizer.warmup_steps = 5 is longer than train.steps = 3; use "
            "warmup_steps <= 3 (e.g. --set optimizer.warmup_steps=0)");
}

TEST_CASE("data path resolution") {
  auto base = ParseJobSpec(kBase, "some/dir/job.yaml");
  REQUIRE(base.ok());
  const fs::path cwd = fs::current_path();

  JobSpec a = *base;  // relative to the spec's folder
  REQUIRE(ResolveAndValidate(&a).ok());
  CHECK(a.data.path == (cwd / "some/dir/data/x").string());

  JobSpec b = *base;  // absolute: only normalized
  REQUIRE(ApplyOverride(&b, "data.path=/srv//data/../tokens/web").ok());
  REQUIRE(ResolveAndValidate(&b).ok());
  CHECK(b.data.path == "/srv/tokens/web");

  JobSpec c = *base;  // from --set: relative to the current directory
  REQUIRE(ApplyOverride(&c, "data.path=../tok/x").ok());
  REQUIRE(ResolveAndValidate(&c).ok());
  CHECK(c.data.path == (cwd / "../tok/x").lexically_normal().string());

  auto d = ParseJobSpec(kBase, "<string>");  // not from a file: the current directory
  REQUIRE(d.ok());
  JobSpec dd = *d;
  REQUIRE(ResolveAndValidate(&dd).ok());
  CHECK(dd.data.path == (cwd / "data/x").string());

  auto e = ParseJobSpec(kBase, "/abs/cfg/job.yaml");
  REQUIRE(e.ok());
  JobSpec ee = *e;
  REQUIRE(ResolveAndValidate(&ee).ok());
  CHECK(ee.data.path == "/abs/cfg/data/x");
}

TEST_CASE("CheckDataFiles names the missing file and how to make it") {
  TempDir tmp;
  WriteText(tmp.path / "job.yaml", kBase);
  auto r = LoadJobSpec((tmp.path / "job.yaml").string());
  REQUIRE(r.ok());
  JobSpec spec = *r;
  REQUIRE(ResolveAndValidate(&spec).ok());
  const std::string prefix = (tmp.path / "data/x").string();
  CHECK(spec.data.path == prefix);

  Status s = CheckDataFiles(spec);
  CHECK(s.code() == Code::kNotFound);
  CHECK_HAS(s.message(), (tmp.path / "job.yaml").string() + ":21:3: data.path: " + prefix + ".bin not found");
  CHECK_HAS(s.message(), "scripts/make_demo_data.sh");
  CHECK_HAS(s.message(), "megascale prepare-data");
  // Before ResolveAndValidate the same resolution applies, and the message shows it.
  CHECK_HAS(CheckDataFiles(*r).message(), "(data.path \"data/x\" resolves to " + prefix + ")");

  fs::create_directories(tmp.path / "data");
  WriteText(prefix + ".bin", "tokens");
  s = CheckDataFiles(spec);
  CHECK(s.code() == Code::kNotFound);
  CHECK_HAS(s.message(), prefix + ".idx not found");

  fs::create_directories(prefix + ".idx");  // a folder where the index should be
  s = CheckDataFiles(spec);
  CHECK(s.code() == Code::kInvalidArgument);
  CHECK_HAS(s.message(), prefix + ".idx is not a regular file");

  fs::remove(prefix + ".idx");
  WriteText(prefix + ".idx", "index");
  CHECK(CheckDataFiles(spec).ok());

  // Unresolved spec: the same resolution applies.
  CHECK(CheckDataFiles(*r).ok());
}

TEST_CASE("LoadJobSpec: missing file, folder, and file name in messages") {
  auto r = LoadJobSpec("/nonexistent/dir/job.yaml");
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kNotFound);
  CHECK_HAS(r.status().message(), "job spec /nonexistent/dir/job.yaml not found");

  TempDir tmp;
  r = LoadJobSpec(tmp.path.string());
  REQUIRE_FALSE(r.ok());
  CHECK_HAS(r.status().message(), "is a directory");

  WriteText(tmp.path / "bad.yaml", "model:\n  heads: 0\n");
  r = LoadJobSpec((tmp.path / "bad.yaml").string());
  REQUIRE_FALSE(r.ok());
  CHECK_HAS(r.status().message(), (tmp.path / "bad.yaml").string() + ":2:10: model.heads: expected a positive integer");
}

// The fixtures under tests/config/bad/ are also used by the CLI tests; each says on its first
// line "# expect: <substring of the error>".
TEST_CASE("bad spec fixtures produce the error they announce") {
  auto files = YamlFiles(kSourceDir + "/tests/config/bad");
  REQUIRE(files.size() >= 4);
  for (const auto& file : files) {
    CAPTURE(file);
    auto text = ReadFile(file.string());
    REQUIRE(text.ok());
    const std::string first = text->substr(0, text->find('\n'));
    const std::string tag = "# expect: ";
    REQUIRE(first.rfind(tag, 0) == 0);
    const std::string expect = first.substr(tag.size());
    std::string m;
    auto r = LoadJobSpec(file.string());
    if (!r.ok()) {
      m = r.status().message();
    } else {
      JobSpec spec = *r;
      Status s = ResolveAndValidate(&spec);
      REQUIRE_FALSE(s.ok());
      m = s.message();
    }
    CHECK_HAS(m, expect);
    CHECK_HAS(m, file.string() + ":");  // file:line:col
  }
}

TEST_CASE("docs/job-spec.md documents every key") {
  auto doc = ReadFile(kSourceDir + "/docs/job-spec.md");
  REQUIRE(doc.ok());
  for (const std::string& key : AllKeys()) CHECK_MESSAGE(Has(*doc, "`" + key + "`"), key);
}

}  // namespace
}  // namespace ms::config

namespace ms::config {

TEST_CASE("parallel.dp: auto is resolved from the tasks a launcher offers") {
  auto spec = ParseJobSpec("parallel: {tp: 2, pp: 2, dp: auto}\ndata: {path: /x}\n", "auto.yaml");
  REQUIRE(spec.ok());
  CHECK(spec->parallel.dp == 0);
  CHECK(ToYaml(*spec).find("dp: auto") != std::string::npos);
  JobSpec outside = *spec;
  Status s = ResolveAndValidate(&outside);
  REQUIRE_FALSE(s.ok());
  CHECK(s.message().find("auto.yaml:1:26: parallel.dp: auto takes dp from the Slurm allocation") == 0);
  JobSpec bad = *spec;
  Status odd = ResolveAutoDataParallel(&bad, 6, "the Slurm allocation (6 tasks)");
  REQUIRE_FALSE(odd.ok());
  CHECK(odd.message().find("offers 6 ranks, which tp * pp = 2 * 2 = 4 does not divide") != std::string::npos);
  REQUIRE(ResolveAutoDataParallel(&*spec, 8, "the Slurm allocation").ok());
  CHECK(spec->parallel.dp == 2);
  CHECK(ResolveAndValidate(&*spec).ok());
  REQUIRE(ApplyOverride(&*spec, "parallel.dp=AUTO").ok());
  CHECK(spec->parallel.dp == 0);
}

}  // namespace ms::config
