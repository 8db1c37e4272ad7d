// The table of job spec keys: type, range, default, parse and print of each.
#include <algorithm>
#include <array>
#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>

#include "config/fields.h"

namespace ms::config {

namespace {
constexpr std::array<std::string_view, 2> kBlockNames = {"parallel", "sequential"};
constexpr std::array<std::string_view, 2> kOptimizerNames = {"adamw", "lamb"};
constexpr std::array<std::string_view, 2> kScheduleNames = {"cosine", "constant"};
constexpr std::array<std::string_view, 3> kBackendNames = {"cpu", "cuda", "auto"};
constexpr std::array<std::string_view, 2> kPrecisionNames = {"fp32", "bf16"};

template <typename E>
constexpr auto EnumNames() {
  if constexpr (std::is_same_v<E, BlockKind>) return kBlockNames;
  if constexpr (std::is_same_v<E, OptimizerKind>) return kOptimizerNames;
  if constexpr (std::is_same_v<E, ScheduleKind>) return kScheduleNames;
  if constexpr (std::is_same_v<E, Backend>) return kBackendNames;
  if constexpr (std::is_same_v<E, Precision>) return kPrecisionNames;
}

template <typename E>
std::string_view EnumName(E v) {
  auto names = EnumNames<E>();
  auto i = static_cast<size_t>(v);
  return i < names.size() ? names[i] : std::string_view("?");
}
}  // namespace

std::string_view Name(BlockKind v) {
  return EnumName(v);
}
std::string_view Name(OptimizerKind v) {
  return EnumName(v);
}
std::string_view Name(ScheduleKind v) {
  return EnumName(v);
}
std::string_view Name(Backend v) {
  return EnumName(v);
}
std::string_view Name(Precision v) {
  return EnumName(v);
}

namespace internal {
namespace {

// ---- scalar parsing -------------------------------------------------------------------

std::string_view StripPlus(std::string_view s) {
  if (!s.empty() && s[0] == '+') s.remove_prefix(1);
  return s;
}

bool ParseDouble(std::string_view s, double* out) {
  s = StripPlus(s);
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size() && std::isfinite(*out);
}

bool ParseFloat(std::string_view s, float* out) {
  s = StripPlus(s);
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size() && std::isfinite(*out);
}

// Decimal integers; also "1e6"-style numbers when they are whole.
template <typename T>
bool ParseInteger(std::string_view s, T* out) {
  s = StripPlus(s);
  if (s.empty()) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  if (r.ec == std::errc() && r.ptr == s.data() + s.size()) return true;
  if (r.ec == std::errc::result_out_of_range) return false;
  double d = 0;
  if (!ParseDouble(s, &d) || d != std::floor(d)) return false;
  // Bounds as doubles: max() + 1 is exact for 32- and 64-bit types.
  const double lo = static_cast<double>(std::numeric_limits<T>::min());
  const double hi_excl = static_cast<double>(std::numeric_limits<T>::max()) + 1.0;
  if (d < lo || d >= hi_excl) return false;
  *out = static_cast<T>(d);
  return true;
}

std::string Lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

bool ParseBool(std::string_view s, bool* out) {
  std::string l = Lower(s);
  if (l == "true" || l == "yes" || l == "on") {
    *out = true;
    return true;
  }
  if (l == "false" || l == "no" || l == "off") {
    *out = false;
    return true;
  }
  return false;
}

// ---- ranges ----------------------------------------------------------------------------

struct Range {
  std::optional<double> lo;
  std::optional<double> hi;
  bool lo_open = false;
  bool hi_open = false;

  bool Contains(double v) const {
    if (lo && (lo_open ? v <= *lo : v < *lo)) return false;
    if (hi && (hi_open ? v >= *hi : v > *hi)) return false;
    return true;
  }
};

Range AtLeast(double lo) {
  return {lo, std::nullopt, false, false};
}
Range Positive() {
  return {0.0, std::nullopt, true, false};
}
Range Closed(double lo, double hi) {
  return {lo, hi, false, false};
}
Range HalfOpen(double lo, double hi) {
  return {lo, hi, false, true};
}

std::string Num(double v) {
  return fmt::format("{}", v);
}

std::string Describe(const Range& r, bool integer) {
  const char* noun = integer ? "integer" : "number";
  if (r.lo && !r.hi) {
    if (*r.lo == 0 && r.lo_open) return fmt::format("a positive {}", noun);
    if (*r.lo == 1 && !r.lo_open && integer) return "a positive integer";
    if (*r.lo == 0 && !r.lo_open) return fmt::format("a non-negative {}", noun);
    return fmt::format("{} {} {}", integer ? "an integer" : "a number", r.lo_open ? ">" : ">=", Num(*r.lo));
  }
  if (r.lo && r.hi) {
    return fmt::format("{} in {}{}, {}{}", integer ? "an integer" : "a number", r.lo_open ? "(" : "[", Num(*r.lo),
                       Num(*r.hi), r.hi_open ? ")" : "]");
  }
  return integer ? "an integer" : "a number";
}

std::string FormatValue(double v) {
  return fmt::format("{}", v);
}
std::string FormatValue(float v) {
  return fmt::format("{}", v);
}
template <typename T>
std::string FormatInt(T v) {
  return fmt::format("{}", v);
}

// ---- field builders ----------------------------------------------------------------------
// `proj` is a generic lambda returning a reference to the field: [](auto& j) -> auto& { ... }.

const JobSpec& Defaults() {
  static const JobSpec defaults;
  return defaults;
}

template <typename Proj>
using ValueType = std::remove_reference_t<decltype(std::declval<Proj>()(std::declval<JobSpec&>()))>;

template <typename Proj>
Field Integer(std::string key, Proj proj, Range range) {
  using T = ValueType<Proj>;
  Field f;
  f.key = std::move(key);
  f.expected = Describe(range, true);
  f.example = FormatInt(proj(Defaults()));
  f.set = [proj, range](JobSpec* j, std::string_view text) {
    T v{};
    if (!ParseInteger(text, &v) || !range.Contains(static_cast<double>(v))) return false;
    proj(*j) = v;
    return true;
  };
  f.get = [proj](const JobSpec& j) { return FormatInt(proj(j)); };
  f.show = f.get;
  f.valid = [proj, range](const JobSpec& j) { return range.Contains(static_cast<double>(proj(j))); };
  return f;
}

// An integer key that also takes "auto" (stored as 0, resolved outside the config module).
template <typename Proj>
Field IntegerOrAuto(std::string key, Proj proj, Range range) {
  Field f = Integer(std::move(key), proj, range);
  f.expected += " or auto";
  f.example = "auto";
  f.choices = {};
  auto set_int = f.set;
  f.set = [set_int, proj](JobSpec* j, std::string_view text) {
    if (Lower(text) == "auto") {
      proj(*j) = 0;
      return true;
    }
    return set_int(j, text);
  };
  f.get = [proj](const JobSpec& j) { return proj(j) == 0 ? std::string("auto") : FormatInt(proj(j)); };
  f.show = f.get;
  f.valid = [proj, range](const JobSpec& j) { return proj(j) == 0 || range.Contains(static_cast<double>(proj(j))); };
  return f;
}

template <typename Proj>
Field Real(std::string key, Proj proj, Range range) {
  using T = ValueType<Proj>;
  Field f;
  f.key = std::move(key);
  f.expected = Describe(range, false);
  f.example = FormatValue(proj(Defaults()));
  f.set = [proj, range](JobSpec* j, std::string_view text) {
    T v{};
    bool ok;
    if constexpr (std::is_same_v<T, float>) {
      ok = ParseFloat(text, &v);
    } else {
      ok = ParseDouble(text, &v);
    }
    if (!ok || !range.Contains(static_cast<double>(v))) return false;
    proj(*j) = v;
    return true;
  };
  f.get = [proj](const JobSpec& j) { return FormatValue(proj(j)); };
  f.show = f.get;
  f.valid = [proj, range](const JobSpec& j) {
    double v = static_cast<double>(proj(j));
    return std::isfinite(v) && range.Contains(v);
  };
  return f;
}

template <typename Proj>
Field Boolean(std::string key, Proj proj) {
  Field f;
  f.key = std::move(key);
  f.expected = "true or false";
  f.example = proj(Defaults()) ? "true" : "false";
  f.set = [proj](JobSpec* j, std::string_view text) { return ParseBool(text, &proj(*j)); };
  f.get = [proj](const JobSpec& j) -> std::string { return proj(j) ? "true" : "false"; };
  f.show = f.get;
  f.valid = [](const JobSpec&) { return true; };
  return f;
}

std::string ChoiceList(const std::vector<std::string>& choices) {
  std::vector<std::string> q;
  for (const auto& c : choices) q.push_back(Quote(c));
  return "one of " + Join(q);
}

// A string; `nonempty` rejects ""; `choices` (if any) restricts the spelling.
template <typename Proj>
Field String(std::string key, Proj proj, bool nonempty, std::vector<std::string> choices = {}) {
  Field f;
  f.key = std::move(key);
  f.is_string = true;
  f.choices = std::move(choices);
  f.expected = !f.choices.empty() ? ChoiceList(f.choices) : nonempty ? "a non-empty string" : "a string";
  f.example = Quote(proj(Defaults()));
  auto allowed = [nonempty, choices = f.choices](std::string_view v) {
    if (nonempty && v.empty()) return false;
    return choices.empty() || std::find(choices.begin(), choices.end(), v) != choices.end();
  };
  f.set = [proj, allowed](JobSpec* j, std::string_view text) {
    if (!allowed(text)) return false;
    proj(*j) = std::string(text);
    return true;
  };
  f.get = [proj](const JobSpec& j) { return Quote(proj(j)); };
  f.show = [proj](const JobSpec& j) { return proj(j); };
  f.valid = [proj, allowed](const JobSpec& j) { return allowed(proj(j)); };
  return f;
}

template <typename Proj>
Field Enum(std::string key, Proj proj) {
  using E = ValueType<Proj>;
  Field f;
  f.key = std::move(key);
  for (auto n : EnumNames<E>()) f.choices.emplace_back(n);
  f.expected = ChoiceList(f.choices);
  f.example = std::string(EnumName(proj(Defaults())));
  f.set = [proj](JobSpec* j, std::string_view text) {
    auto names = EnumNames<E>();
    std::string l = Lower(text);
    for (size_t i = 0; i < names.size(); ++i) {
      if (l == names[i]) {
        proj(*j) = static_cast<E>(i);
        return true;
      }
    }
    return false;
  };
  f.get = [proj](const JobSpec& j) { return std::string(EnumName(proj(j))); };
  f.show = f.get;
  f.valid = [proj](const JobSpec& j) { return static_cast<size_t>(proj(j)) < EnumNames<E>().size(); };
  return f;
}

#define MS_FIELD(path)   \
  [](auto& j) -> auto& { \
    return j.path;       \
  }

std::vector<Field> BuildFields() {
  std::vector<Field> f;
  f.push_back(String("name", MS_FIELD(name), true));
  // model
  f.push_back(Integer("model.layers", MS_FIELD(model.layers), AtLeast(1)));
  f.push_back(Integer("model.hidden", MS_FIELD(model.hidden), AtLeast(1)));
  f.push_back(Integer("model.heads", MS_FIELD(model.heads), AtLeast(1)));
  f.push_back(Integer("model.ffn_hidden", MS_FIELD(model.ffn_hidden), AtLeast(0)));
  f.push_back(Integer("model.vocab", MS_FIELD(model.vocab), AtLeast(1)));
  f.push_back(Integer("model.vocab_pad_to", MS_FIELD(model.vocab_pad_to), AtLeast(1)));
  f.push_back(Integer("model.seq_len", MS_FIELD(model.seq_len), AtLeast(1)));
  f.push_back(Enum("model.block", MS_FIELD(model.block)));
  f.push_back(Integer("model.attention.window", MS_FIELD(model.window), AtLeast(0)));
  f.push_back(String("model.norm", MS_FIELD(model.norm), true, {"layernorm"}));
  f.push_back(Real("model.norm_eps", MS_FIELD(model.norm_eps), Positive()));
  f.push_back(Boolean("model.tied_embeddings", MS_FIELD(model.tied_embeddings)));
  f.push_back(Real("model.init_std", MS_FIELD(model.init_std), Positive()));
  // parallel
  f.push_back(Integer("parallel.tp", MS_FIELD(parallel.tp), AtLeast(1)));
  f.push_back(Integer("parallel.pp", MS_FIELD(parallel.pp), AtLeast(1)));
  f.push_back(IntegerOrAuto("parallel.dp", MS_FIELD(parallel.dp), AtLeast(1)));
  f.back().example = "1";
  f.push_back(Integer("parallel.micro_batches", MS_FIELD(parallel.micro_batches), AtLeast(0)));
  f.push_back(Boolean("parallel.sequence_parallel", MS_FIELD(parallel.sequence_parallel)));
  f.push_back(Integer("parallel.virtual_stages", MS_FIELD(parallel.virtual_stages), AtLeast(1)));
  f.push_back(Integer("parallel.zero", MS_FIELD(parallel.zero), Closed(0, 2)));
  f.push_back(Real("parallel.bucket_mb", MS_FIELD(parallel.bucket_mb), Positive()));
  f.push_back(Boolean("parallel.overlap", MS_FIELD(parallel.overlap)));
  f.push_back(Integer("parallel.tp_comm_chunks", MS_FIELD(parallel.tp_comm_chunks), AtLeast(1)));
  f.push_back(String("parallel.tp_reduce_dtype", MS_FIELD(parallel.tp_reduce_dtype), true, {"fp32", "bf16"}));
  f.push_back(Boolean("parallel.pp_overlap", MS_FIELD(parallel.pp_overlap)));
  // train
  f.push_back(Integer("train.steps", MS_FIELD(train.steps), AtLeast(1)));
  f.push_back(Integer("train.global_batch", MS_FIELD(train.global_batch), AtLeast(1)));
  f.push_back(Integer("train.micro_batch", MS_FIELD(train.micro_batch), AtLeast(0)));
  f.push_back(Integer("train.seed", MS_FIELD(train.seed), AtLeast(0)));
  f.push_back(Enum("train.precision", MS_FIELD(train.precision)));
  f.push_back(Integer("train.eval_interval", MS_FIELD(train.eval_interval), AtLeast(0)));
  f.push_back(Integer("train.eval_batches", MS_FIELD(train.eval_batches), AtLeast(1)));
  // optimizer
  f.push_back(Enum("optimizer.kind", MS_FIELD(optimizer.kind)));
  f.push_back(Real("optimizer.lr", MS_FIELD(optimizer.lr), Positive()));
  f.push_back(Real("optimizer.min_lr", MS_FIELD(optimizer.min_lr), AtLeast(0)));
  f.push_back(Integer("optimizer.warmup_steps", MS_FIELD(optimizer.warmup_steps), AtLeast(0)));
  f.push_back(Enum("optimizer.schedule", MS_FIELD(optimizer.schedule)));
  f.push_back(Real("optimizer.weight_decay", MS_FIELD(optimizer.weight_decay), AtLeast(0)));
  f.push_back(Real("optimizer.beta1", MS_FIELD(optimizer.beta1), HalfOpen(0, 1)));
  f.push_back(Real("optimizer.beta2", MS_FIELD(optimizer.beta2), HalfOpen(0, 1)));
  f.push_back(Real("optimizer.eps", MS_FIELD(optimizer.eps), Positive()));
  f.push_back(Real("optimizer.grad_clip", MS_FIELD(optimizer.grad_clip), AtLeast(0)));
  // data
  f.push_back(String("data.path", MS_FIELD(data.path), false));
  f.back().example = Quote("../data/fortunes");
  f.push_back(String("data.tokenizer", MS_FIELD(data.tokenizer), true));
  f.push_back(Real("data.valid_fraction", MS_FIELD(data.valid_fraction), Closed(0, 0.5)));
  f.push_back(String("data.loader", MS_FIELD(data.loader), true, {"shared", "per_rank"}));
  f.push_back(Integer("data.prefetch", MS_FIELD(data.prefetch), Closed(1, 64)));
  f.push_back(Real("data.loader_timeout_s", MS_FIELD(data.loader_timeout_s), Positive()));
  // checkpoint
  f.push_back(String("checkpoint.dir", MS_FIELD(checkpoint.dir), false));
  f.push_back(Integer("checkpoint.interval", MS_FIELD(checkpoint.interval), AtLeast(0)));
  f.push_back(Integer("checkpoint.keep", MS_FIELD(checkpoint.keep), AtLeast(1)));
  f.push_back(String("checkpoint.resume", MS_FIELD(checkpoint.resume), true, {"none", "auto"}));
  f.push_back(Integer("checkpoint.max_failures", MS_FIELD(checkpoint.max_failures), AtLeast(0)));
  f.push_back(Real("checkpoint.coordination_timeout_s", MS_FIELD(checkpoint.coordination_timeout_s), Positive()));
  // runtime
  f.push_back(Enum("runtime.backend", MS_FIELD(runtime.backend)));
  f.push_back(Integer("runtime.threads", MS_FIELD(runtime.threads), AtLeast(0)));
  f.push_back(String("runtime.redis", MS_FIELD(runtime.redis), false));
  f.push_back(String("runtime.redis_password_file", MS_FIELD(runtime.redis_password_file), false));
  f.push_back(Real("runtime.collective_timeout_s", MS_FIELD(runtime.collective_timeout_s), Positive()));
  f.push_back(Real("runtime.rendezvous_timeout_s", MS_FIELD(runtime.rendezvous_timeout_s), Positive()));
  f.push_back(Real("runtime.stop_grace_s", MS_FIELD(runtime.stop_grace_s), AtLeast(0)));
  f.push_back(String("runtime.interface", MS_FIELD(runtime.interface), false));
  f.push_back(String("runtime.address", MS_FIELD(runtime.address), false));
  f.push_back(Boolean("runtime.fused_kernels", MS_FIELD(runtime.fused_kernels)));
  f.push_back(Boolean("runtime.gemm_epilogues", MS_FIELD(runtime.gemm_epilogues)));
  f.push_back(Boolean("runtime.attention_stored_ds", MS_FIELD(runtime.attention_stored_ds)));
  f.push_back(Boolean("runtime.attention_split_dkdv", MS_FIELD(runtime.attention_split_dkdv)));
  f.push_back(Boolean("runtime.attention_autotune", MS_FIELD(runtime.attention_autotune)));
  f.push_back(Boolean("runtime.cuda_graphs", MS_FIELD(runtime.cuda_graphs)));
  f.push_back(String("runtime.device_comm", MS_FIELD(runtime.device_comm), true, {"auto", "nccl", "gloo"}));
  f.push_back(String("runtime.bf16_operands", MS_FIELD(runtime.bf16_operands), true, {"keep", "cast", "cublas"}));
  f.push_back(String("runtime.activations", MS_FIELD(runtime.activations), true, {"fp32", "bf16"}));
  f.push_back(String("runtime.attention_kernels", MS_FIELD(runtime.attention_kernels), true, {"megascale", "cudnn"}));
  // log
  f.push_back(String("log.run_dir", MS_FIELD(log.run_dir), true));
  f.push_back(Integer("log.interval", MS_FIELD(log.interval), AtLeast(1)));
  f.push_back(Real("log.peak_flops", MS_FIELD(log.peak_flops), AtLeast(0)));
  f.push_back(Boolean("log.trace", MS_FIELD(log.trace)));
  // fault
  f.push_back(Real("fault.heartbeat_s", MS_FIELD(fault.heartbeat_s), AtLeast(0)));
  f.push_back(Real("fault.heartbeat_timeout_s", MS_FIELD(fault.heartbeat_timeout_s), Positive()));
  f.push_back(Real("fault.hang_timeout_s", MS_FIELD(fault.hang_timeout_s), Positive()));
  f.push_back(Integer("fault.max_restarts", MS_FIELD(fault.max_restarts), AtLeast(0)));
  f.push_back(Real("fault.restart_backoff_s", MS_FIELD(fault.restart_backoff_s), AtLeast(0)));
  f.push_back(String("fault.nan_policy", MS_FIELD(fault.nan_policy), true, {"stop", "skip", "rollback"}));
  f.push_back(Real("fault.loss_spike_factor", MS_FIELD(fault.loss_spike_factor), AtLeast(0)));
  f.push_back(String("fault.spike_policy", MS_FIELD(fault.spike_policy), true, {"warn", "rollback"}));
  f.push_back(Real("fault.straggler_ratio", MS_FIELD(fault.straggler_ratio), Positive()));
  f.push_back(Integer("fault.straggler_steps", MS_FIELD(fault.straggler_steps), AtLeast(0)));
  f.push_back(Boolean("fault.self_check", MS_FIELD(fault.self_check)));
  f.push_back(String("fault.self_check_provider", MS_FIELD(fault.self_check_provider), true));
  f.push_back(Real("fault.self_check_tolerance", MS_FIELD(fault.self_check_tolerance), Positive()));
  return f;
}
#undef MS_FIELD

bool StartsWith(std::string_view s, std::string_view p) {
  return s.substr(0, p.size()) == p;
}

}  // namespace

const std::vector<Field>& Fields() {
  static const std::vector<Field> fields = BuildFields();
  return fields;
}

const Field* FindField(std::string_view key) {
  for (const auto& f : Fields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

std::vector<std::string> ChildrenOf(std::string_view prefix) {
  std::vector<std::string> out;
  std::string p = prefix.empty() ? "" : std::string(prefix) + ".";
  for (const auto& f : Fields()) {
    if (!StartsWith(f.key, p)) continue;
    std::string rest = f.key.substr(p.size());
    std::string next = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), next) == out.end()) out.push_back(next);
  }
  return out;
}

bool IsGroup(std::string_view key) {
  std::string p = std::string(key) + ".";
  for (const auto& f : Fields()) {
    if (StartsWith(f.key, p)) return true;
  }
  return false;
}

size_t EditDistance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates) {
  std::string lw = Lower(word);
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const auto& c : candidates) {
    size_t d = EditDistance(lw, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // A typo: at most 2 edits, or a third of the longer word for long keys.
  size_t limit = std::max<size_t>(2, std::max(word.size(), best.size()) / 3);
  if (best.empty() || best_d > limit || best_d >= std::max(word.size(), best.size())) return "";
  return best;
}

std::string Quote(std::string_view text) {
  std::string out = "\"";
  for (char c : text) {
    auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (u < 0x20 || u == 0x7f) {
          out += fmt::format("\\x{:02x}", u);
        } else {
          out += c;
        }
    }
  }
  out += '"';
  return out;
}

std::string Join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += sep;
    out += items[i];
  }
  return out;
}

std::string UnknownKeyMessage(std::string_view section, std::string_view name) {
  std::vector<std::string> children = ChildrenOf(section);
  std::string head = section.empty() ? fmt::format("unknown top-level key {}", Quote(name))
                                     : fmt::format("unknown key {} in {}", Quote(name), section);
  std::string close = ClosestMatch(name, children);
  if (!close.empty()) return fmt::format("{} (did you mean {}?)", head, Quote(close));
  // The same name in another section ("lr" under model)?
  for (const auto& f : Fields()) {
    std::string_view k = f.key;
    auto dot = k.rfind('.');
    std::string_view leaf = dot == std::string_view::npos ? k : k.substr(dot + 1);
    if (leaf == name && k.substr(0, dot == std::string_view::npos ? 0 : dot) != section) {
      return fmt::format("{} (did you mean {}? {} belongs in {})", head, f.key, Quote(name),
                         dot == std::string_view::npos ? std::string("the top level") : std::string(k.substr(0, dot)));
    }
  }
  return fmt::format("{}; valid keys{}: {}", head, section.empty() ? "" : fmt::format(" in {}", section),
                     Join(children));
}

std::string BadValueHint(const Field& field, std::string_view found, bool from_override) {
  if (!field.choices.empty()) {
    std::string close = ClosestMatch(found, field.choices);
    if (!close.empty()) return fmt::format(" (did you mean {}?)", Quote(close));
    return "";  // the expected text already lists the choices
  }
  std::string leaf = field.key.substr(field.key.rfind('.') + 1);
  if (from_override) return fmt::format("; for example --set {}={}", field.key, field.example);
  return fmt::format("; for example {}: {}", leaf, field.example);
}

}  // namespace internal
}  // namespace ms::config
