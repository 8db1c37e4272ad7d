#include "runner/run_dir.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "runner/checkpointing.h"
#include "runner/fault_injection.h"

namespace ms::runner {

Result<DirLock> DirLock::Acquire(const std::string& dir, const std::string& what, const std::string& holder) {
  MS_RETURN_IF_ERROR_CTX(MakeDirs(dir), "creating {} {}", what, dir);
  const std::string path = dir + "/megascale.lock";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(fmt::format("opening the lock file {} of {}", path, what), errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    std::string current;
    char buf[1024];
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    if (n > 0) current.assign(buf, static_cast<size_t>(n));
    while (!current.empty() && (current.back() == '\n' || current.back() == '\0')) current.pop_back();
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return FailedPrecondition(
          "{} {} is in use by another megascale job ({}); two jobs on one directory would corrupt each other's "
          "checkpoints: wait for it to end (or stop it), or give this job another {}",
          what, dir, current.empty() ? "holder unknown" : current, what);
    }
    return ErrnoError(fmt::format("locking {}", path), err);
  }
  // The holder's description, for the message of the next job that finds the directory locked.
  Status wrote = Status::Ok();
  if (::ftruncate(fd, 0) != 0) wrote = ErrnoError(fmt::format("truncating {}", path), errno);
  const std::string text = holder + "\n";
  if (wrote.ok() && ::pwrite(fd, text.data(), text.size(), 0) != static_cast<ssize_t>(text.size())) {
    wrote = ErrnoError(fmt::format("writing {}", path), errno);
  }
  if (!wrote.ok()) {
    ::close(fd);
    return wrote;
  }
  DirLock lock;
  lock.fd_ = fd;
  return lock;
}

DirLock::DirLock(DirLock&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}
DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
}

namespace {

// Step directories of `root` (newest first); an absent root is empty, an unreadable one an error.
Result<std::vector<std::string>> StepDirs(const std::string& root) {
  std::vector<std::string> out;
  DIR* d = ::opendir(root.c_str());
  if (!d) {
    if (errno == ENOENT) return out;
    return ErrnoError(fmt::format("listing checkpoint.dir {}", root), errno);
  }
  errno = 0;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name.starts_with("step-") && name.size() > 5) out.emplace_back(name);
    errno = 0;
  }
  const int read_err = errno;
  ::closedir(d);
  if (read_err) return ErrnoError(fmt::format("listing checkpoint.dir {}", root), read_err);
  std::sort(out.rbegin(), out.rend());
  return out;
}

std::string UtcStamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%dT%H%M%SZ", &tm);
  return buf;
}

// A fresh start: earlier runs' checkpoints and metrics are moved aside, never deleted.
Status SetAsideEarlierRun(const config::JobSpec& spec, const std::vector<std::string>& steps) {
  if (!steps.empty()) {
    std::string aside = fmt::format("{}/superseded-{}", spec.checkpoint.dir, UtcStamp());
    for (int i = 1; std::filesystem::exists(aside); ++i) {
      aside = fmt::format("{}/superseded-{}-{}", spec.checkpoint.dir, UtcStamp(), i);
    }
    MS_RETURN_IF_ERROR(MakeDirs(aside));
    for (const auto& s : steps) {
      const std::string from = spec.checkpoint.dir + "/" + s, to = aside + "/" + s;
      if (::rename(from.c_str(), to.c_str()) != 0) {
        return ErrnoError(fmt::format("moving the earlier run's checkpoint {} to {}", from, to), errno);
      }
    }
    LogWarn(
        "starting from step 1: moved {} checkpoint director{} of an earlier run from {} to {} (kept, so that "
        "no later resume continues that run's lineage; delete it when it is not needed)",
        steps.size(), steps.size() == 1 ? "y" : "ies", spec.checkpoint.dir, aside);
  }
  const std::string metrics = spec.log.run_dir + "/metrics.jsonl";
  struct stat st {};
  if (::stat(metrics.c_str(), &st) == 0 && st.st_size > 0) {
    std::string kept;
    for (int i = 1;; ++i) {
      kept = fmt::format("{}.{}", metrics, i);
      if (!std::filesystem::exists(kept)) break;
    }
    if (::rename(metrics.c_str(), kept.c_str()) != 0) {
      return ErrnoError(fmt::format("keeping the earlier run's {} as {}", metrics, kept), errno);
    }
    LogInfo("starting from step 1: the earlier run's metrics are kept as {}", kept);
  }
  return Status::Ok();
}

}  // namespace

Result<int64_t> ChooseStart(const config::JobSpec& spec, const TrainOptions& options) {
  const std::string& root = spec.checkpoint.dir;
  MS_ASSIGN_OR_RETURN(auto steps, StepDirs(root));
  const bool want = options.resume || spec.checkpoint.resume == "auto";
  if (!want || steps.empty()) {
    if (options.resume) {
      return NotFound(
          "nothing to resume in checkpoint.dir={}: no checkpoint (no step-* directories); start the job "
          "with `megascale train`",
          root);
    }
    if (want) LogInfo("checkpoint.resume: auto: no checkpoint in {} yet, starting from step 1", root);
    MS_RETURN_IF_ERROR(SetAsideEarlierRun(spec, steps));
    return int64_t{-1};
  }
  InjectDelay("resume_scan", -1);
  LogInfo("verifying the newest checkpoint in {} ({} step director{})", root, steps.size(),
          steps.size() == 1 ? "y" : "ies");
  auto latest = checkpoint::FindLatestValid(root, checkpoint::Verify::kFull);
  if (latest.ok()) {
    MS_RETURN_IF_ERROR(CheckCompatible(*latest, spec));
    return latest->step();
  }
  if (!options.start_over) {
    return FailedPrecondition(
        "{} holds {} checkpoint director{} but none can be resumed ({}); the run is not started from step 1 "
        "behind your back: repair or remove them, or pass --start-over to train from step 1 (they are then moved "
        "to {}/superseded-<time>/, not deleted)",
        root, steps.size(), steps.size() == 1 ? "y" : "ies", latest.status().message(), root);
  }
  LogWarn("--start-over: none of the {} checkpoint(s) in {} can be resumed ({}); starting from step 1", steps.size(),
          root, latest.status().message());
  MS_RETURN_IF_ERROR(SetAsideEarlierRun(spec, steps));
  return int64_t{-1};
}

}  // namespace ms::runner
