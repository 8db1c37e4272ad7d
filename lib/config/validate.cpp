// ResolveAndValidate (derived values, cross-field rules) and CheckDataFiles.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <numeric>
#include <system_error>

#include "config/config.h"
#include "config/fields.h"

namespace ms::config {

namespace {

// The key most responsible among `keys` (listed most likely first): one set by --set (the latest
// change), else one written in the file, else the first.
std::string Blame(const JobSpec& spec, std::initializer_list<std::string_view> keys) {
  for (std::string_view k : keys) {
    if (spec.overrides.count(std::string(k))) return std::string(k);
  }
  for (std::string_view k : keys) {
    if (spec.marks.count(std::string(k))) return std::string(k);
  }
  return std::string(*keys.begin());
}

// "<where>: <key>: <message>".
template <typename... Args>
Status Fail(const JobSpec& spec, const std::string& key, fmt::format_string<Args...> f, Args&&... args) {
  return InvalidArgument("{}: {}: {}", KeyLocation(spec, key), key, fmt::format(f, std::forward<Args>(args)...));
}

// "1, 2, 3, 4, 6, 12" (at most 16, then "...").
std::string Divisors(int64_t n) {
  std::vector<std::string> out;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d != 0) continue;
    if (out.size() == 16) {
      out.push_back("...");
      break;
    }
    out.push_back(fmt::format("{}", d));
  }
  return internal::Join(out);
}

// The nearest multiples of m around v: "8 or 12" (just "4" when v < m).
std::string NearMultiples(int64_t v, int64_t m) {
  int64_t down = v / m * m;
  int64_t up = down + m;
  if (down <= 0) return fmt::format("{}", up);
  return fmt::format("{} or {}", down, up);
}

// The divisor of n nearest to v: "heads: 4".
int64_t NearestDivisor(int64_t n, int64_t v) {
  int64_t best = 1;
  for (int64_t d = 1; d <= n; ++d) {
    if (n % d == 0 && std::llabs(d - v) < std::llabs(best - v)) best = d;
  }
  return best;
}

bool SourceIsFile(const JobSpec& spec) {
  return !spec.source.empty() && spec.source.front() != '<';
}

// data.path made absolute: against the spec file's folder, or the current directory when the
// spec is not from a file or the path came from --set.
std::string ResolveDataPath(const JobSpec& spec) {
  namespace fs = std::filesystem;
  fs::path p(spec.data.path);
  if (p.empty()) return "";
  std::error_code ec;
  if (p.is_relative()) {
    fs::path base;
    if (SourceIsFile(spec) && !spec.overrides.count("data.path")) base = fs::path(spec.source).parent_path();
    fs::path cwd = fs::current_path(ec);
    base = base.empty() ? cwd : base.is_absolute() ? base : cwd / base;
    p = base / p;
  }
  return p.lexically_normal().string();
}

Status CheckRanges(const JobSpec& spec) {
  for (const internal::Field& f : internal::Fields()) {
    if (f.valid(spec)) continue;
    std::string shown = f.show(spec);
    return Fail(spec, f.key, "expected {}, found {}{}", f.expected, shown.empty() ? "nothing" : internal::Quote(shown),
                internal::BadValueHint(f, shown, false));
  }
  return Status::Ok();
}

Status ValidateModel(JobSpec* spec) {
  ModelSpec& m = spec->model;
  if (m.ffn_hidden == 0) {
    int64_t ffn = int64_t{4} * m.hidden;
    if (ffn > std::numeric_limits<int>::max()) {
      return Fail(*spec, "model.hidden",
                  "4 * hidden = {} (the default ffn_hidden) does not fit in an int; use a "
                  "smaller hidden or set model.ffn_hidden",
                  ffn);
    }
    m.ffn_hidden = static_cast<int>(ffn);
  }
  if (m.hidden % m.heads != 0) {
    return Fail(*spec, Blame(*spec, {"model.heads", "model.hidden"}),
                "model.hidden = {} is not divisible by model.heads = {} (head dim = hidden / heads must be whole); "
                "use heads: {}, a divisor of {}",
                m.hidden, m.heads, NearestDivisor(m.hidden, m.heads), m.hidden);
  }
  if (m.window > m.seq_len) {
    return Fail(*spec, Blame(*spec, {"model.attention.window", "model.seq_len"}),
                "model.attention.window = {} is larger than model.seq_len = {}; use a window in [0, {}] (0 = full "
                "causal attention)",
                m.window, m.seq_len, m.seq_len);
  }
  return Status::Ok();
}

Status ValidateLayout(const JobSpec& spec) {
  const ModelSpec& m = spec.model;
  const ParallelSpec& p = spec.parallel;
  if (m.heads % p.tp != 0) {
    return Fail(spec, Blame(spec, {"parallel.tp", "model.heads"}),
                "model.heads = {} is not divisible by parallel.tp = {} (each tensor-parallel rank holds heads / tp "
                "whole heads); use tp in {{{}}}",
                m.heads, p.tp, Divisors(m.heads));
  }
  if (m.padded_vocab() % p.tp != 0) {
    const int64_t pad = std::lcm<int64_t>(128, p.tp);
    if (m.vocab_pad_to > 1) {
      return Fail(spec, Blame(spec, {"model.vocab_pad_to", "parallel.tp"}),
                  "model.vocab = {} padded to a multiple of model.vocab_pad_to = {} gives {} rows, not divisible by "
                  "parallel.tp = {} (the vocabulary is split across tensor-parallel ranks); set vocab_pad_to: {}",
                  m.vocab, m.vocab_pad_to, m.padded_vocab(), p.tp, pad);
    }
    return Fail(spec, Blame(spec, {"model.vocab", "parallel.tp"}),
                "model.vocab = {} is not divisible by parallel.tp = {} (the vocabulary is split across "
                "tensor-parallel ranks); pad it with model.vocab_pad_to: {} (the padding stays out of the loss) or "
                "use vocab: {}",
                m.vocab, p.tp, pad, (m.vocab + p.tp - 1) / p.tp * p.tp);
  }
  if (m.ffn_hidden % p.tp != 0) {
    return Fail(spec, Blame(spec, {"model.ffn_hidden", "parallel.tp"}),
                "model.ffn_hidden = {} is not divisible by parallel.tp = {} (the MLP is split by columns across "
                "tensor-parallel ranks); use ffn_hidden: {}",
                m.ffn_hidden, p.tp, NearMultiples(m.ffn_hidden, p.tp));
  }
  if (p.sequence_parallel && m.seq_len % p.tp != 0) {
    return Fail(spec, Blame(spec, {"model.seq_len", "parallel.sequence_parallel", "parallel.tp"}),
                "model.seq_len = {} is not divisible by parallel.tp = {}, which sequence_parallel needs (each "
                "tensor-parallel rank holds seq_len / tp positions); use seq_len: {}, or sequence_parallel: false",
                m.seq_len, p.tp, NearMultiples(m.seq_len, p.tp));
  }
  if (p.virtual_stages > 1 && p.pp == 1) {
    return Fail(spec, "parallel.virtual_stages",
                "virtual_stages = {} needs pipeline parallelism, but parallel.pp = 1; set pp > 1 or virtual_stages: 1",
                p.virtual_stages);
  }
  const int64_t chunks = int64_t{p.pp} * p.virtual_stages;
  if (m.layers % chunks != 0) {
    // Blame virtual_stages when pp alone would divide the layers.
    const bool chunks_fault = p.virtual_stages > 1 && m.layers % p.pp == 0;
    return Fail(spec,
                chunks_fault ? Blame(spec, {"parallel.virtual_stages", "parallel.pp", "model.layers"})
                             : Blame(spec, {"parallel.pp", "parallel.virtual_stages", "model.layers"}),
                "model.layers = {} is not divisible by parallel.pp * parallel.virtual_stages = {} * {} = {} (each "
                "pipeline stage holds an equal number of whole layers); use layers: {}, or pp * virtual_stages in "
                "{{{}}}",
                m.layers, p.pp, p.virtual_stages, chunks, NearMultiples(m.layers, chunks), Divisors(m.layers));
  }
  return Status::Ok();
}

Status ResolveBatch(JobSpec* spec) {
  ParallelSpec& p = spec->parallel;
  TrainSpec& t = spec->train;
  if (t.global_batch % p.dp != 0) {
    return Fail(*spec, Blame(*spec, {"train.global_batch", "parallel.dp"}),
                "train.global_batch = {} is not divisible by parallel.dp = {} (every data-parallel rank takes "
                "global_batch / dp sequences); use global_batch: {}",
                t.global_batch, p.dp, NearMultiples(t.global_batch, p.dp));
  }
  const int per_dp = t.global_batch / p.dp;
  if (t.micro_batch == 0 && p.micro_batches == 0) {
    // pp == 1: one micro-batch (no pipeline to fill); pp > 1: as many micro-batches as possible.
    p.micro_batches = p.pp == 1 ? 1 : per_dp;
    t.micro_batch = per_dp / p.micro_batches;
  } else if (t.micro_batch == 0) {
    if (per_dp % p.micro_batches != 0) {
      return Fail(*spec, Blame(*spec, {"parallel.micro_batches", "train.global_batch"}),
                  "train.global_batch / parallel.dp = {} / {} = {} sequences per data-parallel rank cannot be split "
                  "into parallel.micro_batches = {} equal micro-batches; use micro_batches in {{{}}}",
                  t.global_batch, p.dp, per_dp, p.micro_batches, Divisors(per_dp));
    }
    t.micro_batch = per_dp / p.micro_batches;
  } else if (p.micro_batches == 0) {
    if (per_dp % t.micro_batch != 0) {
      return Fail(*spec, Blame(*spec, {"train.micro_batch", "train.global_batch"}),
                  "train.global_batch / parallel.dp = {} / {} = {} sequences per data-parallel rank cannot be split "
                  "into micro-batches of train.micro_batch = {}; use micro_batch in {{{}}}",
                  t.global_batch, p.dp, per_dp, t.micro_batch, Divisors(per_dp));
    }
    p.micro_batches = per_dp / t.micro_batch;
  } else if (int64_t{t.micro_batch} * p.micro_batches * p.dp != t.global_batch) {
    return Fail(*spec, Blame(*spec, {"train.micro_batch", "parallel.micro_batches", "train.global_batch"}),
                "train.global_batch = {} but train.micro_batch * parallel.micro_batches * parallel.dp = {} * {} * {} "
                "= {}; make them equal, or set micro_batch (or micro_batches) to 0 to derive it",
                t.global_batch, t.micro_batch, p.micro_batches, p.dp, int64_t{t.micro_batch} * p.micro_batches * p.dp);
  }
  if (p.virtual_stages > 1 && p.micro_batches % p.pp != 0) {
    return Fail(*spec, Blame(*spec, {"parallel.micro_batches", "parallel.virtual_stages", "train.global_batch"}),
                "parallel.micro_batches = {} is not a multiple of parallel.pp = {}, which the interleaved schedule "
                "(virtual_stages = {}) needs; use micro_batches: {}, or virtual_stages: 1",
                p.micro_batches, p.pp, p.virtual_stages, NearMultiples(p.micro_batches, p.pp));
  }
  return Status::Ok();
}

Status ValidateTraining(const JobSpec& spec) {
  const TrainSpec& t = spec.train;
  const OptimizerSpec& o = spec.optimizer;
  if (t.precision == Precision::kBf16 && spec.runtime.backend == Backend::kCpu) {
    return Fail(spec, Blame(spec, {"train.precision", "runtime.backend"}),
                "bf16 needs the cuda backend; use precision: fp32 (or runtime.backend: cuda / auto)");
  }
  const RuntimeSpec& r = spec.runtime;
  if (r.activations == "bf16" && (t.precision != Precision::kBf16 || r.backend == Backend::kCpu ||
                                  r.bf16_operands == "cublas" || !r.fused_kernels)) {
    return Fail(spec,
                Blame(spec, {"runtime.activations", "train.precision", "runtime.backend", "runtime.bf16_operands",
                             "runtime.fused_kernels"}),
                "bf16 activations need bf16 GEMMs on bf16 operands (runtime.backend: cuda, train.precision: bf16, "
                "runtime.bf16_operands: keep or cast) and runtime.fused_kernels: true; use runtime.activations: fp32");
  }
  if (r.attention_kernels == "cudnn" && r.activations != "bf16") {
    return Fail(spec, Blame(spec, {"runtime.attention_kernels", "runtime.activations"}),
                "runtime.attention_kernels: cudnn runs the attention of bf16 activations (cuDNN reads bf16 q, k, v and "
                "writes a bf16 output); set runtime.activations: bf16, or runtime.attention_kernels: megascale");
  }
  if (o.min_lr > o.lr) {
    return Fail(spec, Blame(spec, {"optimizer.min_lr", "optimizer.lr"}),
                "optimizer.min_lr = {} is larger than optimizer.lr = {}; use a min_lr in [0, {}]", o.min_lr, o.lr,
                o.lr);
  }
  if (o.warmup_steps > t.steps) {
    return Fail(spec, Blame(spec, {"optimizer.warmup_steps", "train.steps"}),
                "optimizer.warmup_steps = {} is longer than train.steps = {}; use warmup_steps <= {} (e.g. --set "
                "optimizer.warmup_steps={})",
                o.warmup_steps, t.steps, t.steps, t.steps / 10);
  }
  if (t.eval_interval > 0 && spec.data.valid_fraction == 0) {
    return Fail(spec, Blame(spec, {"train.eval_interval", "data.valid_fraction"}),
                "evaluation every {} steps needs a validation split, but data.valid_fraction = 0; set "
                "data.valid_fraction: 0.05, or eval_interval: 0",
                t.eval_interval);
  }
  return Status::Ok();
}

// runtime.redis: "host:port" or "redis://[user@]host:port[/db]", and never a password (the spec is written to
// <run_dir>/job.yaml and printed by validate).
Status ValidateRuntime(const JobSpec& spec) {
  const std::string& url = spec.runtime.redis;
  if (url.empty()) return Status::Ok();
  std::string_view rest = url;
  const bool scheme = rest.starts_with("redis://");
  if (scheme) rest.remove_prefix(8);
  if (rest.find("://") != std::string_view::npos) {
    return Fail(spec, "runtime.redis", "expected host:port or redis://host:port, found a URL of another scheme");
  }
  const size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    if (rest.substr(0, at).find(':') != std::string_view::npos) {
      return Fail(spec, "runtime.redis",
                  "the URL holds a password, which would be written to <run_dir>/job.yaml and printed; remove it and "
                  "give the password in the environment (MEGASCALE_REDIS_PASSWORD) or in a file named by "
                  "runtime.redis_password_file (mode 0600)");
    }
    if (!scheme) return Fail(spec, "runtime.redis", "a user name needs the URL form redis://USER@host:port");
    rest.remove_prefix(at + 1);
  }
  const std::string_view hostport = rest.substr(0, rest.find('/'));
  const size_t colon = hostport.rfind(':');
  const std::string_view host = colon == std::string_view::npos ? hostport : hostport.substr(0, colon);
  const std::string_view port = colon == std::string_view::npos ? "" : hostport.substr(colon + 1);
  int port_value = 0;
  const bool port_ok = !port.empty() && port.size() <= 5 &&
                       std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                       (port_value = std::stoi(std::string(port))) >= 1 && port_value <= 65535;
  if (host.empty() || !port_ok) {
    return Fail(spec, "runtime.redis",
                "expected host:port (e.g. redis-host:6379) or redis://[user@]host:port[/db], found {}; leave it "
                "empty to let the driver start its own redis-server",
                internal::Quote(url));
  }
  return Status::Ok();
}

}  // namespace

Status ResolveAutoDataParallel(JobSpec* spec, int tasks, std::string_view where) {
  ParallelSpec& p = spec->parallel;
  if (p.dp != 0) return Status::Ok();
  const int64_t group = int64_t{p.tp} * p.pp;
  if (tasks <= 0 || tasks % group != 0) {
    return Fail(*spec, "parallel.dp",
                "auto: {} offers {} ranks, which tp * pp = {} * {} = {} does not divide; ask for a multiple of {} "
                "tasks, or set parallel.dp",
                where, tasks, p.tp, p.pp, group, group);
  }
  p.dp = static_cast<int>(tasks / group);
  return Status::Ok();
}

Status ResolveAndValidate(JobSpec* spec) {
  if (spec->parallel.dp == 0) {
    return Fail(*spec, "parallel.dp",
                "auto takes dp from the Slurm allocation (its tasks / (tp * pp)); run inside one (sbatch or salloc), "
                "or set parallel.dp to a number");
  }
  MS_RETURN_IF_ERROR(CheckRanges(*spec));
  MS_RETURN_IF_ERROR(ValidateModel(spec));
  MS_RETURN_IF_ERROR(ValidateLayout(*spec));
  MS_RETURN_IF_ERROR(ResolveBatch(spec));
  MS_RETURN_IF_ERROR(ValidateTraining(*spec));
  MS_RETURN_IF_ERROR(ValidateRuntime(*spec));
  const FaultSpec& f = spec->fault;
  if (f.heartbeat_s > 0 && f.heartbeat_timeout_s < 2 * f.heartbeat_s) {
    return Fail(*spec, Blame(*spec, {"fault.heartbeat_timeout_s", "fault.heartbeat_s"}),
                "fault.heartbeat_timeout_s = {} is less than twice fault.heartbeat_s = {}: one late heartbeat would "
                "count as a lost rank; use heartbeat_timeout_s >= {}",
                f.heartbeat_timeout_s, f.heartbeat_s, 2 * f.heartbeat_s);
  }
  if (spec->data.path.empty()) {
    return Fail(*spec, "data.path",
                "expected the path prefix of the token dataset (<path>.bin and <path>.idx), found nothing; add "
                "data: {{path: ../data/fortunes}} (make it with scripts/make_demo_data.sh) or --set data.path=...");
  }
  spec->data.path = ResolveDataPath(*spec);
  if (spec->checkpoint.dir.empty()) {
    spec->checkpoint.dir = (std::filesystem::path(spec->log.run_dir) / "checkpoints").lexically_normal().string();
  }
  return Status::Ok();
}

Status CheckDataFiles(const JobSpec& spec) {
  const std::string prefix = ResolveDataPath(spec);
  if (prefix.empty()) {
    return Fail(spec, "data.path", "no dataset given; set data.path to the prefix of <path>.bin and <path>.idx");
  }
  for (const char* ext : {".bin", ".idx"}) {
    const std::string file = prefix + ext;
    std::error_code ec;
    auto st = std::filesystem::status(file, ec);
    if (!std::filesystem::exists(st)) {
      std::string resolved = spec.data.path == prefix ? ""
                                                      : fmt::format(" (data.path {} resolves to {})",
                                                                    internal::Quote(spec.data.path), prefix);
      return NotFound(
          "{}: data.path: {} not found{}; make the demo dataset with scripts/make_demo_data.sh, or "
          "tokenize your text with `megascale prepare-data` into {}",
          KeyLocation(spec, "data.path"), file, resolved, prefix);
    }
    if (!std::filesystem::is_regular_file(st)) {
      return InvalidArgument(
          "{}: data.path: {} is not a regular file; data.path names the prefix of <path>.bin and "
          "<path>.idx",
          KeyLocation(spec, "data.path"), file);
    }
  }
  return CheckPasswordFile(spec);
}

Status CheckPasswordFile(const JobSpec& spec) {
  const std::string& path = spec.runtime.redis_password_file;
  if (path.empty()) return Status::Ok();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return NotFound("{}: runtime.redis_password_file: {}: {}; write the password of runtime.redis into it (chmod 600)",
                    KeyLocation(spec, "runtime.redis_password_file"), path, std::strerror(errno));
  }
  if (!S_ISREG(st.st_mode)) {
    return InvalidArgument("{}: runtime.redis_password_file: {} is not a regular file",
                           KeyLocation(spec, "runtime.redis_password_file"), path);
  }
  if ((st.st_mode & 077) != 0) {
    return InvalidArgument(
        "{}: runtime.redis_password_file: {} can be read by other users (mode {:04o}); a password file must be "
        "private: chmod 600 {}",
        KeyLocation(spec, "runtime.redis_password_file"), path, st.st_mode & 07777, path);
  }
  if (::access(path.c_str(), R_OK) != 0) {
    return InvalidArgument("{}: runtime.redis_password_file: {} is not readable: {}",
                           KeyLocation(spec, "runtime.redis_password_file"), path, std::strerror(errno));
  }
  return Status::Ok();
}

}  // namespace ms::config
