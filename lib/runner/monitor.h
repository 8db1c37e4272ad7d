// Internal to the runner: the driver's view of a running attempt through the ranks' heartbeats
// (heartbeat.h), the faults it finds there, the stragglers, and the run's event log.
//
// Faults found here (the driver finds crashes itself, from exit statuses):
//   lost_heartbeat  a rank that beat before and then stopped for fault.heartbeat_timeout_s (a
//                   SIGSTOPped process, a dead or partitioned host, a wedged kernel)
//   hang            every rank beats, but no rank finished a step for fault.hang_timeout_s; the
//                   diagnosis names the collective most ranks wait in and the ranks of that group
//                   that are not in it (the ones holding the others up)
// Stragglers: from the per-step compute times in the heartbeats, a rank whose median compute time
// over the last fault.straggler_steps steps is more than fault.straggler_ratio (and more than 2 ms,
// the scheduling noise of a busy host) above the median of its peers' (the ranks of its pipeline
// stage) is reported (an event, a console line) once per attempt.
// Every rank's per-step times are appended to <run_dir>/rank_timings.jsonl.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/core.h"
#include "metrics/metrics.h"
#include "runner/heartbeat.h"

namespace ms::bootstrap {
class Store;
}

namespace ms::runner {

// A fault of an attempt, as the driver classifies it.
struct Fault {
  std::string kind;  // crash, lost_heartbeat, hang, nan, loss_spike
  int rank = -1;     // the rank it is blamed on (-1: none in particular)
  std::string host;
  std::string detail;           // the diagnosis, one line
  double detect_latency_s = 0;  // from its first evidence (last beat, last progress, exit) to detection
  bool host_fault = true;       // counts against the host (a numeric fault does not)
};

// <run_dir>/events.jsonl: one JSON object per line (fault, recovered, straggler, store_lost,
// attempt, summary), each with the wall-clock time; also shown on the console.
class EventLog {
 public:
  explicit EventLog(std::string path) : path_(std::move(path)) {}
  // Appends `event` (a JSON object whose first members are "time" and "event": kind) as one line.
  // Errors are logged, never fatal: the job goes on without its event log.
  void Write(std::string_view kind, const std::function<void(metrics::JsonObject&)>& fill);

 private:
  std::string path_;
};

class Monitor {
 public:
  Monitor(std::unique_ptr<bootstrap::Store> store, int world, const config::FaultSpec& spec, std::string run_dir,
          int attempt, EventLog* events);
  // Reads every heartbeat (one round trip); returns a lost heartbeat or a hang when it finds one.
  // Reports stragglers. Call about twice a second.
  std::optional<Fault> Poll();
  // After the attempt: reads the ranks' last heartbeats (their final beat holds their last steps)
  // for the timings and stragglers; finds no faults.
  void Finish();
  // The highest step any rank has started, and whether one has finished a step in this attempt.
  int64_t max_step() const { return max_step_; }
  bool first_step_done() const { return first_step_done_; }
  // "step 12, phase backward" (or "no heartbeat yet") for messages about a rank.
  std::string Where(int rank) const;
  std::string HostOf(int rank) const;
  // A note left in the store by the ranks (fault/note, error/<rank>), or "".
  std::string Note(const std::string& key);

 private:
  bool ReadBeats();  // false when the store cannot be read
  void Stragglers(double now);
  std::unique_ptr<bootstrap::Store> store_;
  int world_;
  config::FaultSpec spec_;
  std::string timings_path_;
  int attempt_;
  EventLog* events_;
  struct RankState {
    std::optional<Beat> beat;
    double changed_at = 0;                // driver clock: when its beat counter last changed
    std::map<int64_t, Beat::Step> steps;  // finished steps not yet judged
    std::vector<double> recent;           // compute times of the last judged steps (a window)
    bool flagged = false;
  };
  std::vector<RankState> ranks_;
  double started_ = 0;
  int64_t max_step_ = 0;
  double progress_at_ = 0;  // driver clock: when max_step_ last grew
  bool first_step_done_ = false;
  int64_t judged_through_ = 0;  // steps judged for stragglers
  bool store_warned_ = false;
};

}  // namespace ms::runner
