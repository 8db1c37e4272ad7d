// megascale core: errors as values (Status / Result<T>), logging with a rank prefix, clocks,
// environment helpers and a small Tensor view.
//
// Contract: nothing in lib/ throws across a module API; functions that can fail return
// Status or Result<T>, both [[nodiscard]]. Context is added as an error travels up with
// Status::WithContext ("loading job spec: configs/x.yaml:3:5: ..."). Only main() exits.
// Thread safety: Status/Result are values; logging is safe from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include <fmt/format.h>

namespace ms {

// A small closed set of error codes (as NCCL and Abseil do).
enum class Code {
  kOk = 0,
  kInvalidArgument,     // bad input from the user: job spec, flags, data files
  kNotFound,            // a file, key or checkpoint that should exist does not
  kAlreadyExists,       //
  kFailedPrecondition,  // the system is not in a state to do this
  kOutOfRange,          //
  kIo,                  // a system call on files or sockets failed
  kDataLoss,            // corrupt or truncated data
  kUnavailable,         // a server (Redis, a peer rank) cannot be reached
  kTimeout,             // a wait ran past its deadline
  kAborted,             // cancelled (signal, peer failure)
  kUnimplemented,       // not built into this binary
  kInternal,            // a bug in megascale
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return Status(); }

  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  // "CodeName: message", or "OK".
  std::string ToString() const;
  // Returns a copy whose message is "context: message" (OK stays OK).
  Status WithContext(std::string_view context) const;
  // Marks a status as deliberately ignored.
  void IgnoreError() const {}

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// Named factories, formatted with fmt: InvalidArgument("{}: expected {}", key, what).
#define MS_STATUS_FACTORY(Name, CodeValue)                                 \
  template <typename... Args>                                              \
  Status Name(fmt::format_string<Args...> f, Args&&... args) {             \
    return Status(CodeValue, fmt::format(f, std::forward<Args>(args)...)); \
  }
MS_STATUS_FACTORY(InvalidArgument, Code::kInvalidArgument)
MS_STATUS_FACTORY(NotFound, Code::kNotFound)
MS_STATUS_FACTORY(AlreadyExists, Code::kAlreadyExists)
MS_STATUS_FACTORY(FailedPrecondition, Code::kFailedPrecondition)
MS_STATUS_FACTORY(OutOfRange, Code::kOutOfRange)
MS_STATUS_FACTORY(IoError, Code::kIo)
MS_STATUS_FACTORY(DataLoss, Code::kDataLoss)
MS_STATUS_FACTORY(Unavailable, Code::kUnavailable)
MS_STATUS_FACTORY(Timeout, Code::kTimeout)
MS_STATUS_FACTORY(Aborted, Code::kAborted)
MS_STATUS_FACTORY(Unimplemented, Code::kUnimplemented)
MS_STATUS_FACTORY(Internal, Code::kInternal)
#undef MS_STATUS_FACTORY

// An I/O error from errno: "what: strerror(errno)".
Status ErrnoError(std::string_view what, int err);

template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}        // NOLINT: implicit by design
  Result(Status status) : v_(std::move(status)) {  // NOLINT
    if (std::get<Status>(v_).ok()) v_ = Status(Code::kInternal, "Result built from an OK status");
  }

  bool ok() const { return std::holds_alternative<T>(v_); }
  const Status& status() const {
    static const Status kOk;
    return ok() ? kOk : std::get<Status>(v_);
  }
  T& value() & { return std::get<T>(v_); }
  const T& value() const& { return std::get<T>(v_); }
  T&& value() && { return std::get<T>(std::move(v_)); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }

 private:
  std::variant<T, Status> v_;
};

#define MS_CONCAT_INNER(a, b) a##b
#define MS_CONCAT(a, b) MS_CONCAT_INNER(a, b)

// Returns the status from the enclosing function if it is an error.
#define MS_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ::ms::Status ms_status_ = (expr);        \
    if (!ms_status_.ok()) return ms_status_; \
  } while (0)

// Same, adding context to the message.
#define MS_RETURN_IF_ERROR_CTX(expr, ...)                                          \
  do {                                                                             \
    ::ms::Status ms_status_ = (expr);                                              \
    if (!ms_status_.ok()) return ms_status_.WithContext(fmt::format(__VA_ARGS__)); \
  } while (0)

// MS_ASSIGN_OR_RETURN(auto x, MakeX()); declares/assigns x or returns the error.
#define MS_ASSIGN_OR_RETURN(lhs, expr) MS_ASSIGN_OR_RETURN_IMPL(MS_CONCAT(ms_result_, __LINE__), lhs, expr)
#define MS_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr) \
  auto tmp = (expr);                             \
  if (!tmp.ok()) return tmp.status();            \
  lhs = std::move(tmp).value()

// ---- logging -------------------------------------------------------------------------

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };

// Process-wide log settings. The prefix is "[rank N] " once SetLogRank is called.
void SetLogRank(int rank);
void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
// Also appends every line to this file (nullptr/empty path: stop). Returns an error if it cannot open.
Status SetLogFile(const std::string& path);
void LogLine(LogLevel level, std::string_view message);
// Writes the line to the log file only (when one is set): for lines a progress display shows itself.
void LogFileOnly(std::string_view message);

template <typename... Args>
void LogInfo(fmt::format_string<Args...> f, Args&&... args) {
  if (GetLogLevel() <= LogLevel::kInfo) LogLine(LogLevel::kInfo, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void LogWarn(fmt::format_string<Args...> f, Args&&... args) {
  if (GetLogLevel() <= LogLevel::kWarn) LogLine(LogLevel::kWarn, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void LogError(fmt::format_string<Args...> f, Args&&... args) {
  LogLine(LogLevel::kError, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void LogDebug(fmt::format_string<Args...> f, Args&&... args) {
  if (GetLogLevel() <= LogLevel::kDebug) LogLine(LogLevel::kDebug, fmt::format(f, std::forward<Args>(args)...));
}

// ---- clocks and environment ------------------------------------------------------------

// Monotonic seconds since an arbitrary origin.
double NowSeconds();
// Wall-clock seconds since the Unix epoch (comparable between processes and, NTP permitting, hosts).
double WallSeconds();
// Wall-clock time as ISO 8601 UTC, e.g. 2026-11-22T00:21:31Z.
std::string WallClockIso8601();
// Environment variable or nullopt.
std::optional<std::string> GetEnv(const char* name);
// Number of online CPU cores (>= 1).
int NumCores();
// Hostname of this machine.
std::string HostName();
// The absolute path of this program (/proc/self/exe resolved), for re-executing it elsewhere (a
// Slurm task resolving /proc/self/exe would find slurmstepd).
Result<std::string> SelfExecutable();
// The path of an executable: `name` itself when it holds a '/', else the first executable match in
// PATH (then /usr/sbin and /sbin). NotFound naming it and the PATH searched.
Result<std::string> FindExecutable(const std::string& name);

// ---- files ---------------------------------------------------------------------------

Result<std::string> ReadFile(const std::string& path);
// Writes via "<path>.tmp" + fsync + rename + fsync of the directory: readers see the old
// file or the new one, never half of it.
Status WriteFileAtomic(const std::string& path, std::string_view contents);
// Finishes a file written at `tmp` through `fd`: fsync, close, rename to `path`. On failure the
// temporary file is removed and `path` is left as it was. Does not fsync the directory.
Status CommitTempFile(int fd, const std::string& tmp, const std::string& path);
// mkdir -p.
Status MakeDirs(const std::string& path);

// ---- text ----------------------------------------------------------------------------

// The body of a JSON string literal for `s` (quotes, backslashes and control characters escaped).
std::string JsonEscape(std::string_view s);

// ---- tensors -------------------------------------------------------------------------

enum class DType { kF32, kBF16, kI32 };
size_t DTypeSize(DType dtype);
std::string_view DTypeName(DType dtype);

// bf16 as 16-bit patterns on the host (CPU backend, Gloo's bf16 sums): the upper half of an fp32, rounded to nearest
// even as the CUDA kernels' __float2bfloat16 and the emulator round; a NaN stays a (quiet) NaN. Widening is exact.
inline uint16_t FloatToBf16(float f) {
  uint32_t u;
  static_assert(sizeof u == sizeof f);
  __builtin_memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float Bf16ToFloat(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

// A non-owning view of device or host memory with a shape (row-major, contiguous).
struct Tensor {
  void* data = nullptr;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t nbytes() const { return static_cast<size_t>(numel()) * DTypeSize(dtype); }
  float* f32() const { return static_cast<float*>(data); }
};

// ---- deterministic randomness ----------------------------------------------------------

// SplitMix64-seeded xoshiro256**: small, fast, identical on every platform. Every source of
// randomness in megascale is one of these, seeded from the job seed and a stream id.
class Rng {
 public:
  explicit Rng(uint64_t seed, uint64_t stream = 0);
  uint64_t NextU64();
  // Uniform in [0, 1).
  double NextDouble();
  // Standard normal (Box-Muller, both values used).
  double NextNormal();
  // Uniform integer in [0, n).
  uint64_t NextBelow(uint64_t n);
  // Full state, for checkpoints.
  std::vector<uint64_t> State() const;
  void SetState(const std::vector<uint64_t>& state);

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0;
};

std::string_view Version();

}  // namespace ms
