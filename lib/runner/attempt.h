// Internal to the runner: an ATTEMPT is one launch of every rank of a job and what the driver
// needs to supervise it: deliver signals, learn which ranks exited and how, kill what is left.
// One attempt = the local worker processes of this host (LaunchLocal), or one Slurm job step
// (the Slurm launcher). The supervision policy (signals, grace, failures, the store) is the
// driver's (driver.cpp); an Attempt only reports facts.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::runner {

// How every rank of an attempt is started: `megascale worker ...` of this binary.
struct LaunchPlan {
  std::string exe;  // absolute path of this binary
  int world = 1;
  // The worker's arguments (argv[1..]) for a rank; argument vectors only, never a shell string.
  std::function<std::vector<std::string>(int rank)> args;
  // Variables every rank gets ("NAME=value"), on top of the driver's environment.
  std::vector<std::string> env;
  // Variables of one rank (MEGASCALE_RANK, ...), added after `env`.
  std::function<std::vector<std::string>(int rank)> rank_env;
};

struct RankExit {
  int rank = -1;
  std::string host;         // where it ran ("" when the launcher cannot tell)
  int status = 0;           // wait status (WIFEXITED / WIFSIGNALED)
  bool collateral = false;  // ended because the attempt was stopped (another rank failed), not on its own
};

class Attempt {
 public:
  virtual ~Attempt() = default;
  // Ranks that exited since the last call (each once), with their wait status. Non-blocking.
  virtual std::vector<RankExit> Poll() = 0;
  // True once every rank has exited and been reaped.
  virtual bool AllExited() const = 0;
  // Sends `sig` to every rank still running.
  virtual void Signal(int sig) = 0;
  // SIGKILL to every rank still running; returns when all are reaped.
  virtual void Kill() = 0;
  // Ranks not yet exited.
  virtual std::vector<int> Running() const = 0;
  // How long after a rank's failure its peers' reports may still arrive (the driver waits that long
  // before naming the cause): a local reaping is immediate, srun batches its reports.
  virtual double ReportDelay() const { return 0.2; }
  // What the launcher itself said went wrong (e.g. srun's own error lines), "" if nothing.
  virtual std::string LauncherError() const { return ""; }
};

// Starts `plan.world` worker processes on this host. Each child gets PR_SET_PDEATHSIG(SIGKILL)
// (a rank never outlives its driver) and starts with SIGINT, SIGTERM and SIGUSR1 blocked, so that
// a signal the driver forwards before the worker is ready stays pending instead of killing it
// (the worker's InstallStopSignals takes them with sigwait). On failure to start
// rank r, the ranks already started are killed.
Result<std::unique_ptr<Attempt>> LaunchLocal(const LaunchPlan& plan);

// One Slurm job step: `srun` of this binary's worker on the allocation's nodes, `tasks_per_node`
// ranks per node in block order (rank r on node r / tasks_per_node, so tensor-parallel groups stay
// inside a node when tasks_per_node is a multiple of tp). Each task takes its rank, local rank and
// node from Slurm's variables (SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID). Argument vectors only:
// job names and paths with spaces, quotes or $(...) reach the workers untouched.
//   Signals: sent to the step's tasks by its own id (`scancel --signal=SIG <job>.<step>`, the id
//     looked up among this job's steps by the step's unique name); Kill cancels the step by id.
//   Exits: srun's stderr is passed through to ours and its "srun: error: <node>: task <n>: <cause>"
//     lines are reported as they come (rank, node, cause); when srun ends, the other ranks take
//     its exit status (or are collateral of a reported failure).
struct SlurmStep {
  std::string job_id;  // SLURM_JOB_ID
  int nodes = 1;       // --nodes
  int tasks_per_node = 1;
  std::string name;                                                   // --job-name of the step: unique to this attempt
  std::vector<std::string> exclude;                                   // --exclude: hosts found bad by earlier attempts
  std::string srun = "srun", squeue = "squeue", scancel = "scancel";  // looked up in PATH
};
Result<std::unique_ptr<Attempt>> LaunchSlurmStep(const LaunchPlan& plan, const SlurmStep& step);

// The ranks an srun report line names, with their end: "srun: error: node1: task 3: Killed",
// "srun: error: node0: tasks 0-2,5: Exited with exit code 1"; none for any other line.
std::vector<RankExit> ParseSrunTaskLine(std::string_view line, int world);

// Runs a command (argument vector, looked up in PATH) and returns its standard output; an error
// naming the command and its exit status or standard error when it fails or outlasts timeout_s.
Result<std::string> CaptureCommand(const std::vector<std::string>& argv, double timeout_s);

// One child process: fork + exec of `argv` with `env` as its whole environment. `parent_pid` is
// the process the child must belong to: the child checks after PR_SET_PDEATHSIG that its parent
// is still that process (it may have died before the death signal was armed) and exits with 127
// otherwise. Tests pass another pid to see that check work.
struct SpawnSpec {
  std::vector<std::string> argv;  // argv[0]: a path, or a name looked up in PATH
  std::vector<std::string> env;
  pid_t parent_pid = 0;  // 0: getpid()
  int stdout_fd = -1;    // >= 0: the child's standard output (e.g. a pipe); -1: inherited
  int stderr_fd = -1;    // likewise for standard error
};
Result<pid_t> Spawn(const SpawnSpec& spec);

// The environment of this process with `overrides` ("NAME=value") replacing or adding variables.
std::vector<std::string> MergedEnvironment(const std::vector<std::string>& overrides);

// "exit code 3", "signal 9 (Killed)".
std::string DescribeExit(int status);

}  // namespace ms::runner
