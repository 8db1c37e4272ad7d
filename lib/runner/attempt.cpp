// LaunchLocal: the ranks of an attempt as child processes of the driver on this host.
#include "runner/attempt.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

extern char** environ;

namespace ms::runner {

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return fmt::format("exit code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return fmt::format("signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return "unknown status";
}

std::vector<std::string> MergedEnvironment(const std::vector<std::string>& overrides) {
  auto name_of = [](std::string_view kv) { return kv.substr(0, kv.find('=') + 1); };
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) {
    std::string_view kv(*e);
    bool overridden = false;
    for (const auto& o : overrides) overridden |= name_of(kv) == name_of(o);
    if (!overridden) out.emplace_back(kv);
  }
  out.insert(out.end(), overrides.begin(), overrides.end());
  return out;
}

Result<pid_t> Spawn(const SpawnSpec& spec) {
  if (spec.argv.empty()) return InvalidArgument("Spawn: empty argument vector");
  MS_ASSIGN_OR_RETURN(const std::string exe, FindExecutable(spec.argv[0]));
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (size_t i = 1; i < spec.argv.size(); ++i) argv.push_back(const_cast<char*>(spec.argv[i].c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> envs = spec.env;
  std::vector<char*> envp;
  for (auto& e : envs) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = spec.parent_pid > 0 ? spec.parent_pid : getpid();
  // The stop signals are blocked from before fork until the worker installs its handlers.
  sigset_t stop, old;
  sigemptyset(&stop);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&stop, sig);
  pthread_sigmask(SIG_BLOCK, &stop, &old);
  const pid_t pid = fork();
  if (pid == 0) {
    // Child: async-signal-safe calls only until exec.
    prctl(PR_SET_PDEATHSIG, SIGKILL);     // a rank never outlives its driver ...
    if (getppid() != parent) _exit(127);  // ... including one that died before the line above
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGPIPE, &dfl, nullptr);  // ignored here (InstallStopSignals), and SIG_IGN survives exec
    if (spec.stdout_fd >= 0) dup2(spec.stdout_fd, 1);
    if (spec.stderr_fd >= 0) dup2(spec.stderr_fd, 2);
    execve(argv[0], argv.data(), envp.data());
    const char msg[] = "error: cannot exec the launched program\n";
    ssize_t ignored = write(2, msg, sizeof msg - 1);
    (void)ignored;
    _exit(127);
  }
  const int err = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) return ErrnoError(fmt::format("fork of {}", spec.argv[0]), err);
  return pid;
}

namespace {

class LocalAttempt final : public Attempt {
 public:
  ~LocalAttempt() override { Kill(); }

  Status Start(const LaunchPlan& plan) {
    const std::string host = HostName();
    for (int r = 0; r < plan.world; ++r) {
      SpawnSpec s;
      s.argv = {plan.exe};
      for (auto& a : plan.args(r)) s.argv.push_back(a);
      std::vector<std::string> env = plan.env;
      if (plan.rank_env) {
        for (auto& e : plan.rank_env(r)) env.push_back(e);
      }
      s.env = MergedEnvironment(env);
      auto pid = Spawn(s);
      if (!pid.ok()) {
        Kill();
        return pid.status().WithContext(fmt::format("starting rank {}", r));
      }
      ranks_.push_back({r, *pid, false});
      host_ = host;
    }
    return Status::Ok();
  }

  std::vector<RankExit> Poll() override {
    std::vector<RankExit> out = std::move(killed_);
    killed_.clear();
    for (auto& c : ranks_) {
      if (c.done) continue;
      int status = 0;
      const pid_t r = waitpid(c.pid, &status, WNOHANG);  // only our own children, never -1
      if (r == c.pid) {
        c.done = true;
        out.push_back({c.rank, host_, status});
      } else if (r < 0 && errno == ECHILD) {
        c.done = true;  // reaped elsewhere: should not happen
        out.push_back({c.rank, host_, 0xff00});
      }
    }
    return out;
  }

  bool AllExited() const override {
    for (const auto& c : ranks_) {
      if (!c.done) return false;
    }
    return true;
  }

  void Signal(int sig) override {
    for (const auto& c : ranks_) {
      if (!c.done) kill(c.pid, sig);  // ESRCH: it is exiting; Poll() reaps it
    }
  }

  // The killed ranks are reported by the next Poll().
  void Kill() override {
    for (auto& c : ranks_) {
      if (c.done) continue;
      kill(c.pid, SIGKILL);
      int status = 0;
      while (waitpid(c.pid, &status, 0) < 0 && errno == EINTR) {
      }
      c.done = true;
      killed_.push_back({c.rank, host_, status});
    }
  }

  std::vector<int> Running() const override {
    std::vector<int> out;
    for (const auto& c : ranks_) {
      if (!c.done) out.push_back(c.rank);
    }
    return out;
  }

 private:
  struct Child {
    int rank;
    pid_t pid;
    bool done;
  };
  std::vector<Child> ranks_;
  std::vector<RankExit> killed_;
  std::string host_;
};

}  // namespace

Result<std::unique_ptr<Attempt>> LaunchLocal(const LaunchPlan& plan) {
  auto a = std::make_unique<LocalAttempt>();
  MS_RETURN_IF_ERROR(a->Start(plan));
  return std::unique_ptr<Attempt>(std::move(a));
}

}  // namespace ms::runner
