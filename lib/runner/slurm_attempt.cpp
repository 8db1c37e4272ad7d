// LaunchSlurmStep: the ranks of an attempt as one Slurm job step (srun), and CaptureCommand.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "runner/attempt.h"

namespace ms::runner {

Result<std::string> CaptureCommand(const std::vector<std::string>& argv, double timeout_s) {
  int out[2], err[2];
  if (pipe2(out, O_CLOEXEC) != 0) return ErrnoError("pipe", errno);
  if (pipe2(err, O_CLOEXEC) != 0) {
    const int e = errno;
    close(out[0]);
    close(out[1]);
    return ErrnoError("pipe", e);
  }
  SpawnSpec s;
  s.argv = argv;
  s.env = MergedEnvironment({});
  s.stdout_fd = out[1];
  s.stderr_fd = err[1];
  auto pid = Spawn(s);
  close(out[1]);
  close(err[1]);
  if (!pid.ok()) {
    close(out[0]);
    close(err[0]);
    return pid.status();
  }
  std::string text[2];
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  const double deadline = NowSeconds() + timeout_s;
  int open_fds = 2;
  while (open_fds > 0 && NowSeconds() < deadline) {
    if (poll(fds, 2, 100) < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[4096];
      const ssize_t n = read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        text[i].append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
      }
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) close(f.fd);
  }
  if (open_fds > 0) kill(*pid, SIGKILL);
  int status = 0;
  while (waitpid(*pid, &status, 0) < 0 && errno == EINTR) {
  }
  std::string cmd = argv.empty() ? "" : argv[0];
  if (open_fds > 0) return Timeout("{} did not finish within {:.0f} s", cmd, timeout_s);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    while (!text[1].empty() && text[1].back() == '\n') text[1].pop_back();
    return Unavailable("{} failed ({}): {}", cmd, DescribeExit(status), text[1].empty() ? "no message" : text[1]);
  }
  return text[0];
}

namespace {

// "0-3,5" -> 0 1 2 3 5.
std::vector<int> ParseTaskList(std::string_view list) {
  std::vector<int> out;
  size_t start = 0;
  while (start < list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string_view::npos) end = list.size();
    std::string_view item = list.substr(start, end - start);
    const size_t dash = item.find('-');
    int lo = 0, hi = 0;
    std::string_view a = item.substr(0, dash), b = dash == std::string_view::npos ? a : item.substr(dash + 1);
    if (std::from_chars(a.data(), a.data() + a.size(), lo).ec == std::errc() &&
        std::from_chars(b.data(), b.data() + b.size(), hi).ec == std::errc()) {
      for (int t = lo; t <= hi && t - lo < 1000000; ++t) out.push_back(t);
    }
    start = end + 1;
  }
  return out;
}

// A wait status for srun's description of a task's end: "Killed", "Terminated", "Segmentation
// fault", "Exited with exit code 3".
int StatusOf(std::string_view cause) {
  static constexpr std::string_view kExit = "Exited with exit code ";
  if (cause.starts_with(kExit)) {
    int code = 1;
    std::string_view n = cause.substr(kExit.size());
    std::from_chars(n.data(), n.data() + n.size(), code);
    return (code & 0xff) << 8;
  }
  for (int sig = 1; sig < 32; ++sig) {
    const char* name = strsignal(sig);
    if (name && cause.starts_with(name)) return sig;  // WIFSIGNALED with WTERMSIG = sig
  }
  return 1 << 8;
}

}  // namespace

std::vector<RankExit> ParseSrunTaskLine(std::string_view line, int world) {
  static constexpr std::string_view kError = "srun: error: ";
  std::vector<RankExit> out;
  if (!line.starts_with(kError)) return out;
  std::string_view rest = line.substr(kError.size());
  const size_t c1 = rest.find(": task");
  if (c1 == std::string_view::npos) return out;
  const std::string node(rest.substr(0, c1));
  rest = rest.substr(c1 + 2);  // "task 3: Killed" or "tasks 0-2,5: Exited with exit code 1"
  const size_t space = rest.find(' '), colon = rest.find(": ");
  if (space == std::string_view::npos || colon == std::string_view::npos || colon < space) return out;
  const int status = StatusOf(rest.substr(colon + 2));
  for (int t : ParseTaskList(rest.substr(space + 1, colon - space - 1))) {
    if (t >= 0 && t < world) out.push_back({t, node, status, false});
  }
  return out;
}

namespace {

class SlurmAttempt final : public Attempt {
 public:
  SlurmAttempt(int world, SlurmStep step) : world_(world), step_(std::move(step)) {}
  ~SlurmAttempt() override {
    Kill();
    if (reader_.joinable()) reader_.join();
  }

  Status Start(const LaunchPlan& plan) {
    int err[2];
    if (pipe2(err, O_CLOEXEC) != 0) return ErrnoError("pipe for srun's standard error", errno);
    SpawnSpec s;
    s.argv = {step_.srun,
              fmt::format("--nodes={}", step_.nodes),
              fmt::format("--ntasks={}", world_),
              fmt::format("--ntasks-per-node={}", step_.tasks_per_node),
              "--distribution=block:block",
              fmt::format("--job-name={}", step_.name),
              "--kill-on-bad-exit=0",  // the driver decides: it names the cause, then cancels the step
              "--export=ALL"};
    if (!step_.exclude.empty()) {
      std::string list;
      for (const auto& h : step_.exclude) list += (list.empty() ? "" : ",") + h;
      s.argv.push_back("--exclude=" + list);
    }
    s.argv.push_back(plan.exe);
    for (auto& a : plan.args(0)) s.argv.push_back(a);
    // Each task takes its rank and local rank from Slurm; none may come from the driver's own.
    std::vector<std::string> env;
    for (const auto& e : MergedEnvironment(plan.env)) {
      if (!e.starts_with("MEGASCALE_RANK=") && !e.starts_with("MEGASCALE_LOCAL_RANK=") &&
          !e.starts_with("MEGASCALE_LOCAL_WORLD=") && !e.starts_with("MEGASCALE_LISTEN_ADDRESS=")) {
        env.push_back(e);
      }
    }
    s.env = std::move(env);
    s.stderr_fd = err[1];
    auto pid = Spawn(s);
    close(err[1]);
    if (!pid.ok()) {
      close(err[0]);
      return pid.status().WithContext("starting the job step with srun");
    }
    srun_ = *pid;
    reader_ = std::thread([this, fd = err[0]] { ReadStderr(fd); });
    return Status::Ok();
  }

  std::vector<RankExit> Poll() override {
    std::vector<RankExit> out;
    {
      std::lock_guard<std::mutex> lock(mu_);
      out = std::move(parsed_);
      parsed_.clear();
    }
    for (const auto& e : out) reported_.insert(e.rank);
    if (srun_ > 0) {
      int status = 0;
      if (waitpid(srun_, &status, WNOHANG) == srun_) {
        srun_ = -1;
        srun_status_ = status;
        if (reader_.joinable()) reader_.join();  // srun closed its stderr: every line is in
        std::lock_guard<std::mutex> lock(mu_);
        for (auto& e : parsed_) {
          reported_.insert(e.rank);
          out.push_back(std::move(e));
        }
        parsed_.clear();
      }
    }
    if (srun_ < 0 && !done_) {
      done_ = true;
      // The ranks srun named nothing about end with the step: with its status when that is a
      // clean end (0, 75, 130), else as collateral of a named failure (or of the launch's own).
      const int code = WIFEXITED(srun_status_) ? WEXITSTATUS(srun_status_) : -1;
      const bool clean = code == 0 || code == 75 || code == 130;
      bool named_failure = false;
      for (int r : reported_) named_failure |= r >= 0;
      for (int r = 0; r < world_; ++r) {
        if (reported_.count(r)) continue;
        RankExit e;
        e.rank = r;
        e.status = clean ? srun_status_ : (killed_ ? SIGKILL : srun_status_);
        e.collateral = !clean && (named_failure || killed_);
        out.push_back(e);
      }
    }
    return out;
  }

  bool AllExited() const override { return done_; }

  void Signal(int sig) override {
    if (srun_ <= 0) return;
    const std::string id = StepId();
    if (id.empty()) {
      // The step is not registered yet: srun forwards TERM and USR1 to its tasks (and the tasks
      // keep signals that arrive during start-up pending).
      if (sig != SIGINT) kill(srun_, sig);
      return;
    }
    auto r = CaptureCommand({step_.scancel, fmt::format("--signal={}", sigabbrev_np(sig)), id}, 30);
    if (!r.ok()) LogInfo("signalling job step {} (it may be ending already): {}", id, r.status().message());
  }

  void Kill() override {
    if (srun_ <= 0) return;
    killed_ = true;
    const std::string id = StepId();
    if (!id.empty()) {
      auto r = CaptureCommand({step_.scancel, id}, 30);  // by its own id, never by a name pattern
      if (!r.ok()) LogWarn("cancelling job step {}: {}", id, r.status().message());
    }
    // srun ends once the step is gone; if it does not, it goes (and Slurm cleans the step up).
    const double deadline = NowSeconds() + 30;
    while (NowSeconds() < deadline) {
      int status = 0;
      if (waitpid(srun_, &status, WNOHANG) == srun_) {
        srun_status_ = status;
        srun_ = -1;
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    kill(srun_, SIGKILL);
    int status = 0;
    while (waitpid(srun_, &status, 0) < 0 && errno == EINTR) {
    }
    srun_status_ = status;
    srun_ = -1;
  }

  std::vector<int> Running() const override {
    std::vector<int> out;
    if (done_) return out;
    for (int r = 0; r < world_; ++r) {
      if (!reported_.count(r)) out.push_back(r);
    }
    return out;
  }

  double ReportDelay() const override { return 1.5; }

  std::string LauncherError() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return launcher_error_;
  }

 private:
  // "<job>.<step>" of this attempt's step, looked up by its unique name among this job's steps.
  std::string StepId() {
    if (!step_id_.empty()) return step_id_;
    auto out = CaptureCommand(
        {step_.squeue, "--steps", fmt::format("--jobs={}", step_.job_id), "--noheader", "--format=%i %j"}, 30);
    if (!out.ok()) {
      LogWarn("looking up the job step: {}", out.status().message());
      return "";
    }
    size_t start = 0;
    while (start < out->size()) {
      size_t end = out->find('\n', start);
      if (end == std::string::npos) end = out->size();
      std::string_view line(out->data() + start, end - start);
      const size_t space = line.find(' ');
      if (space != std::string_view::npos && line.substr(space + 1) == step_.name) {
        step_id_ = std::string(line.substr(0, space));
        break;
      }
      start = end + 1;
    }
    return step_id_;
  }

  // Passes srun's standard error through and notes "srun: error: <node>: task(s) <list>: <cause>".
  void ReadStderr(int fd) {
    std::string pending;
    char buf[4096];
    while (true) {
      const ssize_t n = read(fd, buf, sizeof buf);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      ssize_t written = 0;
      while (written < n) {
        const ssize_t w = write(2, buf + written, static_cast<size_t>(n - written));
        if (w <= 0) break;
        written += w;
      }
      pending.append(buf, static_cast<size_t>(n));
      size_t nl;
      while ((nl = pending.find('\n')) != std::string::npos) {
        Parse(std::string_view(pending).substr(0, nl));
        pending.erase(0, nl + 1);
      }
    }
    close(fd);
  }

  void Parse(std::string_view line) {
    static constexpr std::string_view kError = "srun: error: ";
    // "slurmstepd-node0: error: *** STEP 12.0 ON node0 CANCELLED AT ..." (also "*** JOB 12 ..."): the
    // step was cancelled from outside; what its ranks report after this is its consequence.
    if (line.find(" CANCELLED AT ") != std::string_view::npos && line.find("*** ") != std::string_view::npos) {
      std::lock_guard<std::mutex> lock(mu_);
      cancelled_ = true;
      if (launcher_error_.empty()) {
        const size_t star = line.find("*** ");
        launcher_error_ = fmt::format("the job step was cancelled from outside ({})", line.substr(star));
      }
      return;
    }
    if (!line.starts_with(kError)) return;
    std::string_view rest = line.substr(kError.size());
    const size_t c1 = rest.find(": task");
    if (c1 == std::string_view::npos) {
      std::lock_guard<std::mutex> lock(mu_);
      if (launcher_error_.empty()) launcher_error_ = std::string(line);
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (RankExit& e : ParseSrunTaskLine(line, world_)) {
      if (seen_.count(e.rank)) continue;
      seen_.insert(e.rank);
      e.collateral = killed_.load() || cancelled_;
      parsed_.push_back(std::move(e));
    }
  }

  const int world_;
  SlurmStep step_;
  pid_t srun_ = -1;
  int srun_status_ = 0;
  bool done_ = false;
  std::atomic<bool> killed_{false};
  std::string step_id_;
  std::set<int> reported_;
  std::thread reader_;
  mutable std::mutex mu_;         // guards the fields below (the reader thread fills them)
  std::vector<RankExit> parsed_;  // not yet returned by Poll()
  std::set<int> seen_;
  std::string launcher_error_;
  bool cancelled_ = false;  // a "*** STEP ... CANCELLED AT" line was seen
};

}  // namespace

Result<std::unique_ptr<Attempt>> LaunchSlurmStep(const LaunchPlan& plan, const SlurmStep& step) {
  auto a = std::make_unique<SlurmAttempt>(plan.world, step);
  MS_RETURN_IF_ERROR(a->Start(plan));
  return std::unique_ptr<Attempt>(std::move(a));
}

}  // namespace ms::runner
