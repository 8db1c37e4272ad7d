// Internal to the runner: what the driver does to the run and checkpoint directories before it
// launches anything.
//
// Locking: DirLock holds an exclusive flock(2) on <dir>/megascale.lock for the job's lifetime and
// writes the holder's description into it (host, pid, job, start time). The kernel drops the lock
// when the holder exits however it exits, so a crashed job never leaves a stale lock; flock works
// on local file systems and on NFS (emulated with POSIX locks); on Lustre it needs the `flock`
// mount option.
//
// Where to start (ChooseStart):
//   - checkpoint.resume: auto, or `megascale resume`: the newest valid checkpoint (manifest and
//     every file's size and CRC32C verified here, by the driver, before any rank is launched).
//     No step directory at all: step 1 (auto) or an error (resume). Step directories exist but
//     none is usable (damaged, truncated, unreadable): an error naming each one and why, unless
//     --start-over. A directory that cannot be listed (EACCES, EIO) is an error, never "empty".
//   - A run that starts from step 1 while checkpoint.dir holds step directories (resume: none,
//     or --start-over) moves them into checkpoint.dir/superseded-<UTC time>/, so that a later
//     resume never continues another run's lineage; nothing is deleted.
//   - A run that starts from step 1 keeps an existing metrics.jsonl as metrics.jsonl.N (the next
//     free N): history is never truncated. A resumed run appends to it.
#pragma once

#include <cstdint>
#include <string>

#include "config/config.h"
#include "core/core.h"
#include "runner/runner.h"

namespace ms::runner {

class DirLock {
 public:
  // Takes the lock of `dir` (created if missing) for `what` ("log.run_dir", "checkpoint.dir").
  // FailedPrecondition naming the directory, the holder and the fix when another job holds it.
  static Result<DirLock> Acquire(const std::string& dir, const std::string& what, const std::string& holder);
  DirLock(DirLock&& other) noexcept;
  DirLock& operator=(DirLock&& other) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  ~DirLock();  // releases the lock (the file stays: it names the last holder)

 private:
  DirLock() = default;
  int fd_ = -1;
};

// The step to resume from (-1: start from step 1), after moving aside what a fresh start must
// not mix with (see above). Logs what it decided.
Result<int64_t> ChooseStart(const config::JobSpec& spec, const TrainOptions& options);

}  // namespace ms::runner
