// Internal to the runner: what a rank is doing, and the heartbeat that tells the driver.
//
// ProgressBoard: the training thread (and every communicator wait) records the step, the phase
// (data, forward, backward, optimizer step, the collective it waits in and its group, checkpoint,
// evaluation) and each finished step's time split into compute and communication. Only atomics:
// the heartbeat thread reads it without a lock, so a rank stuck in compute or in a collective still
// beats and says where it is stuck.
//
// Heartbeat: a background thread with its own store connection that every `period` publishes the
// board under key hb/<rank> of the attempt's namespace, as "key=value" lines:
//   n=<beat counter> t=<unix seconds> rank= host= pid= pp=<pipeline rank> groups=<tp[0],pp[1],...>
//   step= phase= phase_s=<seconds in it> wait=<op> on <group> wait_s=<seconds> (only while waiting)
//   steps=<step>:<step_s>:<compute_s>:<comm_s>,...   (the last finished steps, oldest first)
// ParseHeartbeat reads it back (the driver).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/core.h"

namespace ms::bootstrap {
class Store;
}

namespace ms::runner {

enum class Phase : int { kStartup, kData, kForward, kBackward, kOptimizer, kCheckpoint, kEval, kDone };
const char* PhaseName(Phase p);

class ProgressBoard {
 public:
  // Groups are registered before the heartbeat starts (then the list is read-only).
  int RegisterGroup(const std::string& name);
  const std::vector<std::string>& groups() const { return groups_; }
  void set_pp_rank(int pp) { pp_rank_ = pp; }
  int pp_rank() const { return pp_rank_; }

  void SetStep(int64_t step) { step_.store(step, std::memory_order_relaxed); }
  void SetPhase(Phase p);
  // A wait inside a collective or a transfer of `group` (an id from RegisterGroup); `op` a literal.
  void EnterWait(int group, const char* op);
  void LeaveWait();
  // A finished step: its wall time and the part spent computing and communicating.
  void RecordStep(int64_t step, double step_s, double compute_s, double comm_s);

  // The heartbeat text (see above), less n, t, rank, host and pid.
  std::string Snapshot() const;

 private:
  static constexpr int kRing = 64;
  struct Slot {
    std::atomic<uint64_t> seq{0};  // odd while being written
    std::atomic<int64_t> step{0};
    std::atomic<double> step_s{0}, compute_s{0}, comm_s{0};
  };
  std::vector<std::string> groups_;
  int pp_rank_ = 0;
  std::atomic<int64_t> step_{0};
  std::atomic<int> phase_{static_cast<int>(Phase::kStartup)};
  std::atomic<double> phase_since_{NowSeconds()};
  std::atomic<int> wait_group_{-1};
  std::atomic<const char*> wait_op_{nullptr};
  std::atomic<double> wait_since_{0};
  std::array<Slot, kRing> ring_;
  std::atomic<uint64_t> next_{0};
};

// Wraps a communicator so that every Wait() is recorded on the board as a wait in `group`, and the
// time of each call (posting and waiting) is added to the calling thread's ThreadWaitedSeconds().
std::unique_ptr<comm::Communicator> TrackWaits(std::unique_ptr<comm::Communicator> inner, ProgressBoard* board,
                                               int group);

// Seconds the calling thread has spent inside communicators wrapped by TrackWaits (a running
// total): what a step of the training thread did not compute, whichever collective it waited in.
double ThreadWaitedSeconds();

class Heartbeat {
 public:
  // Publishes every `period_s` from its own thread over `store` (a connection of its own).
  static std::unique_ptr<Heartbeat> Start(std::unique_ptr<bootstrap::Store> store, int rank, std::string host,
                                          double period_s, const ProgressBoard* board);
  ~Heartbeat();  // stops the thread (a last beat says phase "done")
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

 private:
  struct Impl;
  explicit Heartbeat(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// A heartbeat as the driver sees it.
struct Beat {
  int64_t n = 0;
  double t = 0;
  int rank = -1;
  std::string host;
  int pid = 0;
  int pp_rank = 0;
  std::vector<std::string> groups;
  int64_t step = 0;
  std::string phase;  // "done" once the rank finished its last step (and in its final beat)
  double phase_s = 0;
  bool exited = false;              // its final beat (final=1): the rank is leaving, and silent from now on
  std::string wait_op, wait_group;  // empty when not waiting
  double wait_s = 0;
  struct Step {
    int64_t step;
    double step_s, compute_s, comm_s;
  };
  std::vector<Step> steps;
};
Result<Beat> ParseHeartbeat(const std::string& text);
std::string HeartbeatKey(int rank);

}  // namespace ms::runner
