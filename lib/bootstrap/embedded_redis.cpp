// EmbeddedRedis: a private redis-server child, stopped by its PID.
#include <arpa/inet.h>
#include <fcntl.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {
namespace {

// A port the kernel considers free on `address` (IPv4); a race with another process is handled
// by retrying the start.
Result<int> FreePort(const std::string& address) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (inet_pton(AF_INET, address.c_str(), &addr.sin_addr) != 1) {
    return InvalidArgument("embedded redis-server: bind address '{}' is not an IPv4 address", address);
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoError("socket", errno);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Status s = ErrnoError(fmt::format("bind {}:0", address), errno);
    close(fd);
    return s;
  }
  socklen_t len = sizeof(addr);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    Status s = ErrnoError("getsockname", errno);
    close(fd);
    return s;
  }
  close(fd);
  return static_cast<int>(ntohs(addr.sin_port));
}

Result<std::string> RandomHex(size_t bytes) {
  std::string raw(bytes, '\0');
  size_t got = 0;
  while (got < bytes) {
    ssize_t n = getrandom(raw.data() + got, bytes - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError("getrandom", errno);
    }
    got += static_cast<size_t>(n);
  }
  std::string out;
  for (unsigned char ch : raw) out += fmt::format("{:02x}", ch);
  return out;
}

std::string FileTail(const std::string& path, size_t max_bytes = 1500) {
  auto text = ReadFile(path);
  if (!text.ok()) return "(no log)";
  const std::string& t = *text;
  return t.size() > max_bytes ? "..." + t.substr(t.size() - max_bytes) : t;
}

// Sends sig, then polls waitpid until the child is gone or the timeout passes.
bool SignalAndReap(pid_t pid, int sig, Millis timeout) {
  if (kill(pid, sig) != 0 && errno == ESRCH) {
    waitpid(pid, nullptr, WNOHANG);
    return true;
  }
  const double deadline = NowSeconds() + timeout.count() / 1000.0;
  while (true) {
    int status = 0;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return true;
    if (NowSeconds() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// A redis.conf argument in double quotes (paths may hold spaces and quotes): backslash, quote and
// non-printable bytes escaped the way redis-server's parser (sdssplitargs) reads them.
std::string ConfQuote(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c >= 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// Asks the server to exit without saving (it ignores the stop signals, see the header).
bool ShutdownNoSave(const std::string& address, int port, const std::string& password) {
  timeval tv{2, 0};
  redisContext* c = redisConnectWithTimeout(address.c_str(), port, tv);
  if (c == nullptr) return false;
  bool sent = false;
  if (!c->err && redisSetTimeout(c, tv) == REDIS_OK) {
    bool authed = true;
    if (!password.empty()) {
      auto* r = static_cast<redisReply*>(redisCommand(c, "AUTH %b", password.data(), password.size()));
      authed = r != nullptr && r->type != REDIS_REPLY_ERROR;
      if (r) freeReplyObject(r);
    }
    if (authed) {
      // A successful SHUTDOWN closes the connection without a reply.
      auto* r = static_cast<redisReply*>(redisCommand(c, "SHUTDOWN NOSAVE"));
      sent = r == nullptr || r->type != REDIS_REPLY_ERROR;
      if (r) freeReplyObject(r);
    }
  }
  redisFree(c);
  return sent;
}

}  // namespace

Result<EmbeddedRedis> EmbeddedRedis::Start(const EmbeddedRedisOptions& options) {
  EmbeddedRedis r;  // removes the directory if we fail below
  auto exe = FindExecutable(options.executable);
  if (!exe.ok()) {
    return NotFound("{}: install it with scripts/setup.sh (Debian package redis-server), or give the job a Redis URL",
                    exe.status().message());
  }
  r.exe_ = *exe;
  r.options_ = options;
  std::string parent = options.temp_parent;
  if (parent.empty()) parent = GetEnv("TMPDIR").value_or("/tmp");
  std::string templ = parent + "/megascale-redis-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return ErrnoError(fmt::format("mkdtemp {}", templ), errno);
  r.dir_ = templ;
  MS_ASSIGN_OR_RETURN(r.password_, RandomHex(16));
  Status last = Status::Ok();
  for (int try_port = 0; try_port < 5; ++try_port) {
    MS_ASSIGN_OR_RETURN(int port, FreePort(options.bind_address));
    last = r.Launch(port);
    if (last.ok()) return r;
    if (last.message().find("in use") == std::string::npos) return last;  // only a port race is worth retrying
  }
  return last;
}

Status EmbeddedRedis::Launch(int port) {
  const std::string conf = dir_ + "/redis.conf";
  const std::string log = dir_ + "/redis.log";
  const std::string out = dir_ + "/stdout.log";
  const std::string& bind = options_.bind_address;
  std::string text = fmt::format(
      "bind {}\nport {}\nprotected-mode yes\nsave \"\"\nappendonly no\ntcp-backlog 4096\nmaxclients {}\n"
      "pidfile {}\nlogfile {}\ndir {}\ndaemonize no\nrequirepass {}\n",
      bind, port, options_.max_clients, ConfQuote(dir_ + "/redis.pid"), ConfQuote(log), ConfQuote(dir_), password_);
  {
    int fd = open(conf.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return ErrnoError(fmt::format("create {}", conf), errno);
    ssize_t n = write(fd, text.data(), text.size());
    int err = errno;
    close(fd);
    if (n != static_cast<ssize_t>(text.size())) return ErrnoError(fmt::format("write {}", conf), err);
  }
  // The job's stop signals stay blocked in the server (a blocked signal stays pending across exec,
  // and redis-server does not unblock them), so it outlives the ranks' last checkpoint.
  sigset_t stop_signals, old_mask;
  sigemptyset(&stop_signals);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2}) sigaddset(&stop_signals, sig);
  const pid_t parent_pid = getpid();
  pthread_sigmask(SIG_BLOCK, &stop_signals, &old_mask);  // no handler runs between fork and exec
  pid_t pid = fork();
  if (pid < 0) {
    int err = errno;
    pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
    return ErrnoError("fork for redis-server", err);
  }
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec. SIGKILL: the stop signals are blocked.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent_pid) _exit(127);
    int devnull = open("/dev/null", O_RDONLY);
    int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (devnull >= 0) dup2(devnull, 0);
    if (o >= 0) {
      dup2(o, 1);
      dup2(o, 2);
    }
    setpgid(0, 0);  // not in the terminal's process group: Ctrl-C reaches only the driver
    char* argv[] = {const_cast<char*>(exe_.c_str()), const_cast<char*>(conf.c_str()), nullptr};
    execv(exe_.c_str(), argv);
    _exit(127);
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  pid_ = pid;
  port_ = port;
  url_ = fmt::format("redis://{}:{}/0", bind, port);

  // Wait for PING.
  const double deadline = NowSeconds() + options_.startup_timeout.count() / 1000.0;
  while (true) {
    int status = 0;
    if (waitpid(pid, &status, WNOHANG) == pid) {
      pid_ = -1;
      return Unavailable("embedded redis-server exited at start on {}:{}: {}", bind, port, LogTail());
    }
    StoreOptions so;
    so.url = url_;
    so.password = password_;
    so.connect_retries = 0;
    so.connect_timeout = Millis(500);
    so.op_timeout = Millis(1000);
    auto store = ConnectRedisStore(so);  // AUTH + PING
    if (store.ok()) {
      LogInfo("embedded redis-server pid {} on {}:{} (dir {})", pid, bind, port, dir_);
      return Status::Ok();
    }
    if (NowSeconds() > deadline) {
      Status last = Unavailable("embedded redis-server (pid {}) did not answer PING on {}:{} within {} ms: {}; log: {}",
                                pid, bind, port, options_.startup_timeout.count(), store.status().message(), LogTail());
      SignalAndReap(pid, SIGKILL, Millis(5000));
      pid_ = -1;
      return last;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

std::string EmbeddedRedis::LogTail() const {
  return FileTail(dir_ + "/redis.log") + FileTail(dir_ + "/stdout.log");
}

std::optional<int> EmbeddedRedis::PollExit() {
  if (pid_ <= 0) return std::nullopt;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) != pid_) return std::nullopt;
  pid_ = -1;
  return status;
}

Status EmbeddedRedis::Restart() {
  if (pid_ > 0) return FailedPrecondition("embedded redis-server pid {} is still running", pid_);
  if (dir_.empty() || port_ == 0) return FailedPrecondition("embedded redis-server was never started");
  return Launch(port_);
}

EmbeddedRedis::EmbeddedRedis(EmbeddedRedis&& other) noexcept {
  *this = std::move(other);
}

EmbeddedRedis& EmbeddedRedis::operator=(EmbeddedRedis&& other) noexcept {
  if (this != &other) {
    Stop().IgnoreError();  // the destructor path: errors were logged
    pid_ = std::exchange(other.pid_, -1);
    port_ = std::exchange(other.port_, 0);
    url_ = std::exchange(other.url_, {});
    password_ = std::exchange(other.password_, {});
    dir_ = std::exchange(other.dir_, {});
    exe_ = std::exchange(other.exe_, {});
    options_ = other.options_;
  }
  return *this;
}

EmbeddedRedis::~EmbeddedRedis() {
  Status s = Stop();
  if (!s.ok()) LogWarn("stopping embedded redis: {}", s.message());
}

Status EmbeddedRedis::Stop() {
  Status result = Status::Ok();
  if (pid_ > 0) {
    const pid_t pid = pid_;
    const bool asked = ShutdownNoSave(options_.bind_address, port_, password_);
    if (!asked || !SignalAndReap(pid, 0, options_.stop_timeout)) {
      LogWarn("embedded redis-server pid {} did not shut down{}; sending SIGKILL", pid,
              asked ? fmt::format(" within {} ms", options_.stop_timeout.count()) : " on request");
      if (!SignalAndReap(pid, SIGKILL, Millis(5000))) {
        result = Internal("embedded redis-server pid {} survived SIGKILL", pid);
      }
    }
    pid_ = -1;
  }
  if (!dir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
    if (ec && result.ok()) result = IoError("removing {}: {}", dir_, ec.message());
    dir_.clear();
  }
  return result;
}

}  // namespace ms::bootstrap
