// EmbeddedRedis: a private redis-server child, stopped by its PID.
#include <fcntl.h>
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

Result<std::string> FindExecutable(const std::string& name) {
  if (name.find('/') != std::string::npos) {
    if (access(name.c_str(), X_OK) == 0) return name;
  } else {
    std::string path = GetEnv("PATH").value_or("/usr/local/bin:/usr/bin:/bin");
    path += ":/usr/sbin:/sbin";  // Debian puts redis-server in /usr/bin, but be lenient
    size_t start = 0;
    while (start <= path.size()) {
      size_t end = path.find(':', start);
      if (end == std::string::npos) end = path.size();
      std::string dir = path.substr(start, end - start);
      if (!dir.empty()) {
        std::string candidate = dir + "/" + name;
        if (access(candidate.c_str(), X_OK) == 0) return candidate;
      }
      start = end + 1;
    }
  }
  return NotFound(
      "'{}' not found in PATH: install it with scripts/setup.sh (Debian package redis-server), or give "
      "the job a Redis URL",
      name);
}

Result<int> FreeLoopbackPort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return ErrnoError("socket", errno);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    Status s = ErrnoError("bind 127.0.0.1:0", errno);
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

std::string LogTail(const std::string& path, size_t max_bytes = 1500) {
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

}  // namespace

Result<EmbeddedRedis> EmbeddedRedis::Start(const EmbeddedRedisOptions& options) {
  MS_ASSIGN_OR_RETURN(std::string exe, FindExecutable(options.executable));
  std::string parent = options.temp_parent;
  if (parent.empty()) parent = GetEnv("TMPDIR").value_or("/tmp");
  std::string templ = parent + "/megascale-redis-XXXXXX";
  if (mkdtemp(templ.data()) == nullptr) return ErrnoError(fmt::format("mkdtemp {}", templ), errno);

  EmbeddedRedis r;  // removes the directory if we fail below
  r.dir_ = templ;
  r.stop_timeout_ = options.stop_timeout;
  MS_ASSIGN_OR_RETURN(std::string password, RandomHex(16));

  Status last = Status::Ok();
  for (int try_port = 0; try_port < 5; ++try_port) {
    MS_ASSIGN_OR_RETURN(int port, FreeLoopbackPort());
    const std::string conf = r.dir_ + "/redis.conf";
    const std::string log = r.dir_ + "/redis.log";
    const std::string out = r.dir_ + "/stdout.log";
    std::string text = fmt::format(
        "bind 127.0.0.1\nport {}\nprotected-mode yes\nsave \"\"\nappendonly no\ntcp-backlog 4096\nmaxclients {}\n"
        "pidfile {}/redis.pid\nlogfile {}\ndir {}\ndaemonize no\nrequirepass {}\n",
        port, options.max_clients, r.dir_, log, r.dir_, password);
    {
      int fd = open(conf.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      if (fd < 0) return ErrnoError(fmt::format("create {}", conf), errno);
      ssize_t n = write(fd, text.data(), text.size());
      int err = errno;
      close(fd);
      if (n != static_cast<ssize_t>(text.size())) return ErrnoError(fmt::format("write {}", conf), err);
    }
    const pid_t parent_pid = getpid();
    pid_t pid = fork();
    if (pid < 0) return ErrnoError("fork for redis-server", errno);
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent_pid) _exit(127);
      int devnull = open("/dev/null", O_RDONLY);
      int o = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
      if (devnull >= 0) dup2(devnull, 0);
      if (o >= 0) {
        dup2(o, 1);
        dup2(o, 2);
      }
      setpgid(0, 0);  // not in the terminal's process group: Ctrl-C reaches only the driver
      char* argv[] = {const_cast<char*>(exe.c_str()), const_cast<char*>(conf.c_str()), nullptr};
      execv(exe.c_str(), argv);
      _exit(127);
    }
    r.pid_ = pid;
    r.port_ = port;
    r.url_ = fmt::format("redis://:{}@127.0.0.1:{}/0", password, port);

    // Wait for PING.
    const double deadline = NowSeconds() + options.startup_timeout.count() / 1000.0;
    bool exited = false;
    while (true) {
      int status = 0;
      if (waitpid(pid, &status, WNOHANG) == pid) {
        exited = true;
        r.pid_ = -1;
        break;
      }
      StoreOptions so;
      so.url = r.url_;
      so.connect_retries = 0;
      so.connect_timeout = Millis(500);
      so.op_timeout = Millis(1000);
      auto store = ConnectRedisStore(so);  // AUTH + PING
      if (store.ok()) {
        LogInfo("embedded redis-server pid {} on 127.0.0.1:{} (dir {})", pid, port, r.dir_);
        return r;
      }
      if (NowSeconds() > deadline) {
        last = Unavailable(
            "embedded redis-server (pid {}) did not answer PING on 127.0.0.1:{} within {} ms: {}; log: {}", pid, port,
            options.startup_timeout.count(), store.status().message(), LogTail(log) + LogTail(out));
        MS_RETURN_IF_ERROR(r.Stop());
        return last;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (exited) {
      std::string tail = LogTail(log) + LogTail(out);
      last = Unavailable("embedded redis-server exited at start on port {}: {}", port, tail);
      if (tail.find("in use") == std::string::npos) return last;  // only a port race is worth retrying
    }
  }
  return last;
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
    dir_ = std::exchange(other.dir_, {});
    stop_timeout_ = other.stop_timeout_;
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
    if (!SignalAndReap(pid, SIGTERM, stop_timeout_)) {
      LogWarn("embedded redis-server pid {} ignored SIGTERM for {} ms; sending SIGKILL", pid, stop_timeout_.count());
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
