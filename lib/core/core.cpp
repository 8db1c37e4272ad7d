#include "core/core.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <sstream>

namespace ms {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "OK";
    case Code::kInvalidArgument:
      return "InvalidArgument";
    case Code::kNotFound:
      return "NotFound";
    case Code::kAlreadyExists:
      return "AlreadyExists";
    case Code::kFailedPrecondition:
      return "FailedPrecondition";
    case Code::kOutOfRange:
      return "OutOfRange";
    case Code::kIo:
      return "IoError";
    case Code::kDataLoss:
      return "DataLoss";
    case Code::kUnavailable:
      return "Unavailable";
    case Code::kTimeout:
      return "Timeout";
    case Code::kAborted:
      return "Aborted";
    case Code::kUnimplemented:
      return "Unimplemented";
    case Code::kInternal:
      return "Internal";
  }
  return "Unknown";
}

std::string Status::ToString() const {
  if (ok()) return "OK";
  return fmt::format("{}: {}", CodeName(code_), message_);
}

Status Status::WithContext(std::string_view context) const {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", context, message_));
}

Status ErrnoError(std::string_view what, int err) {
  Code code = Code::kIo;
  if (err == ENOENT) code = Code::kNotFound;
  if (err == EEXIST) code = Code::kAlreadyExists;
  return Status(code, fmt::format("{}: {}", what, std::strerror(err)));
}

// ---- logging ----
namespace {
struct LogState {
  std::mutex mu;
  int rank = -1;
  LogLevel level = LogLevel::kInfo;
  FILE* file = nullptr;
};
LogState& Log() {
  static LogState* s = new LogState();  // never destroyed: usable during static destruction
  return *s;
}
const char* LevelTag(LogLevel l) {
  switch (l) {
    case LogLevel::kDebug:
      return "D";
    case LogLevel::kInfo:
      return "I";
    case LogLevel::kWarn:
      return "W";
    case LogLevel::kError:
      return "E";
  }
  return "?";
}
}  // namespace

void SetLogRank(int rank) {
  std::lock_guard<std::mutex> lock(Log().mu);
  Log().rank = rank;
}
void SetLogLevel(LogLevel level) {
  std::lock_guard<std::mutex> lock(Log().mu);
  Log().level = level;
}
LogLevel GetLogLevel() {
  return Log().level;
}

Status SetLogFile(const std::string& path) {
  std::lock_guard<std::mutex> lock(Log().mu);
  if (Log().file) {
    std::fclose(Log().file);
    Log().file = nullptr;
  }
  if (path.empty()) return Status::Ok();
  FILE* f = std::fopen(path.c_str(), "a");
  if (!f) return ErrnoError(fmt::format("opening log file {}", path), errno);
  Log().file = f;
  return Status::Ok();
}

void LogLine(LogLevel level, std::string_view message) {
  std::lock_guard<std::mutex> lock(Log().mu);
  std::string prefix = Log().rank >= 0 ? fmt::format("[rank {}] ", Log().rank) : std::string();
  std::string line = fmt::format("{} {}{}\n", LevelTag(level), prefix, message);
  std::fputs(line.c_str(), stderr);
  if (Log().file) {
    std::string stamped = fmt::format("{} {}", WallClockIso8601(), line);
    std::fputs(stamped.c_str(), Log().file);
    std::fflush(Log().file);
  }
}

void LogFileOnly(std::string_view message) {
  std::lock_guard<std::mutex> lock(Log().mu);
  if (!Log().file) return;
  std::string prefix = Log().rank >= 0 ? fmt::format("[rank {}] ", Log().rank) : std::string();
  std::string line = fmt::format("{} I {}{}\n", WallClockIso8601(), prefix, message);
  std::fputs(line.c_str(), Log().file);
  std::fflush(Log().file);
}

// ---- clocks and environment ----
double NowSeconds() {
  using namespace std::chrono;
  return duration<double>(steady_clock::now().time_since_epoch()).count();
}

std::string WallClockIso8601() {
  std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

double WallSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

std::optional<std::string> GetEnv(const char* name) {
  const char* v = std::getenv(name);
  if (!v) return std::nullopt;
  return std::string(v);
}

int NumCores() {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

Result<std::string> SelfExecutable() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n < 0) return ErrnoError("readlink /proc/self/exe", errno);
  return std::string(buf, static_cast<size_t>(n));
}

Result<std::string> FindExecutable(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (access(name.c_str(), X_OK) == 0) return name;
    return NotFound("'{}' is not an executable file", name);
  }
  const std::string path = GetEnv("PATH").value_or("/usr/local/bin:/usr/bin:/bin") + ":/usr/sbin:/sbin";
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = path.find(':', start);
    if (end == std::string::npos) end = path.size();
    if (end > start) {
      const std::string candidate = path.substr(start, end - start) + "/" + name;
      if (access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    start = end + 1;
  }
  return NotFound("'{}' not found in PATH ({})", name, path);
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "unknown";
  return buf;
}

// ---- files ----
Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return ErrnoError(fmt::format("opening {}", path), errno ? errno : ENOENT);
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return IoError("reading {}", path);
  return ss.str();
}

static Status FsyncDir(const std::string& path) {
  std::string dir = ".";
  auto slash = path.rfind('/');
  if (slash != std::string::npos) dir = slash == 0 ? "/" : path.substr(0, slash);
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return ErrnoError(fmt::format("opening directory {}", dir), errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(fmt::format("fsync of directory {}", dir), err);
  return Status::Ok();
}

Status WriteFileAtomic(const std::string& path, std::string_view contents) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(fmt::format("creating {}", tmp), errno);
  size_t done = 0;
  while (done < contents.size()) {
    ssize_t n = ::write(fd, contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return ErrnoError(fmt::format("writing {}", tmp), err);
    }
    done += static_cast<size_t>(n);
  }
  MS_RETURN_IF_ERROR(CommitTempFile(fd, tmp, path));
  return FsyncDir(path);
}

Status CommitTempFile(int fd, const std::string& tmp, const std::string& path) {
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    ::unlink(tmp.c_str());
    return ErrnoError(fmt::format("fsync of {}", tmp), err);
  }
  if (::close(fd) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoError(fmt::format("closing {}", tmp), err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoError(fmt::format("renaming {} to {}", tmp, path), err);
  }
  return Status::Ok();
}

Status MakeDirs(const std::string& path) {
  if (path.empty()) return Status::Ok();
  std::string cur;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    cur = path.substr(0, pos);
    if (cur.empty()) continue;
    if (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoError(fmt::format("creating directory {}", cur), errno);
    }
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return FailedPrecondition("{} exists and is not a directory", path);
  }
  return Status::Ok();
}

// ---- text ----
std::string JsonEscape(std::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
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
        if (c < 0x20) {
          out += fmt::format("\\u{:04x}", c);
        } else {
          out += ch;
        }
    }
  }
  return out;
}

// ---- tensors ----
size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return 4;
    case DType::kBF16:
      return 2;
    case DType::kI32:
      return 4;
  }
  return 0;
}
std::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
  }
  return "?";
}

// ---- rng ----
static uint64_t SplitMix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static uint64_t Rotl(uint64_t x, int k) {
  return (x << k) | (x >> (64 - k));
}

Rng::Rng(uint64_t seed, uint64_t stream) {
  uint64_t x = seed ^ (stream * 0xd1342543de82ef95ULL + 0x2545f4914f6cdd1dULL);
  for (auto& s : s_) s = SplitMix64(x);
}
uint64_t Rng::NextU64() {
  uint64_t result = Rotl(s_[1] * 5, 7) * 9;
  uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = Rotl(s_[3], 45);
  return result;
}
double Rng::NextDouble() {
  return static_cast<double>(NextU64() >> 11) * 0x1.0p-53;
}
double Rng::NextNormal() {
  if (has_spare_) {
    has_spare_ = false;
    return spare_;
  }
  double u1 = NextDouble(), u2 = NextDouble();
  if (u1 < 1e-300) u1 = 1e-300;
  double r = std::sqrt(-2.0 * std::log(u1));
  spare_ = r * std::sin(2 * M_PI * u2);
  has_spare_ = true;
  return r * std::cos(2 * M_PI * u2);
}
uint64_t Rng::NextBelow(uint64_t n) {
  if (n <= 1) return 0;
  uint64_t limit = UINT64_MAX - UINT64_MAX % n;
  uint64_t x;
  do x = NextU64();
  while (x >= limit);
  return x % n;
}
std::vector<uint64_t> Rng::State() const {
  uint64_t spare_bits;
  std::memcpy(&spare_bits, &spare_, 8);
  return {s_[0], s_[1], s_[2], s_[3], has_spare_ ? 1ULL : 0ULL, spare_bits};
}
void Rng::SetState(const std::vector<uint64_t>& st) {
  for (int i = 0; i < 4; ++i) s_[i] = st.at(i);
  has_spare_ = st.size() > 4 && st[4];
  if (st.size() > 5) std::memcpy(&spare_, &st[5], 8);
}

std::string_view Version() {
  return "0.1.0";
}

}  // namespace ms
