// Internal to the runner: where a rank's training batches come from (data.loader).
//
//   per_rank  every rank that needs tokens reads its micro-batches from the dataset itself.
//   shared    one loader per HOST, a thread of the host's local rank 0 (the rank that also makes the
//             host's segment), reads every micro-batch the host's ranks need, once, through the
//             job's sampler, data.prefetch steps ahead, into a POSIX shared-memory ring
//             (/dev/shm/megascale-<uid>-<job key>-<job id>-a<attempt>-h<host>, mode 0600). Ranks
//             of one data-parallel index share one copy; each copies its part of a step out of the
//             ring at its first fetch of the step, which frees the slot. Ranks that need no tokens
//             (pipeline stages other than the first and the last) do not attach at all.
//
// Both give the same samples: training sample k of the run (k = consumed samples before this
// run's first step + (step - first step) * global_batch + (dp * micro_batches + mb) * micro + i)
// goes to data-parallel rank dp, micro-batch mb, row i. The position (consumed samples) is saved
// in every checkpoint, so a resume in any layout continues the sequence of samples exactly.
//
// Safety of the ring: a slot is written between two sequence numbers (odd while written, even
// when complete) with a checksum per data-parallel part; a reader checks both around its copy.
// A reader waits only while the loader is behind (that wait is data_wait_s); it fails with an
// error naming the loader when the loader reports a failure, its process is gone (checked every
// 0.1 s), or it published nothing for data.loader_timeout_s. The loader stops waiting for a slot
// when a reader's process is gone, and reports that. Stale segments of this job (a crashed or
// killed attempt) are removed by the next attempt's local rank 0 and by the driver after each
// attempt; the owner unlinks its segment when it ends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "config/config.h"
#include "core/core.h"
#include "data/data.h"
#include "runner/runner.h"

namespace ms::runner {

// Which training samples a step's micro-batches hold.
struct DataPosition {
  int64_t start_step = 1;        // the first step of this run
  int64_t consumed_samples = 0;  // training samples consumed before start_step (from the checkpoint)
  int64_t global_batch = 1;
  int micro = 1;    // rows of a micro-batch
  int n_micro = 1;  // micro-batches per step and data-parallel rank
  int64_t FirstSample(int64_t step, int dp, int mb) const {
    return consumed_samples + (step - start_step) * global_batch + (static_cast<int64_t>(dp) * n_micro + mb) * micro;
  }
  // Samples consumed once `step` is done.
  int64_t ConsumedAfter(int64_t step) const { return consumed_samples + (step - start_step + 1) * global_batch; }
};

// What a rank gets its batches from. Not thread-safe: one training thread calls it.
class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // inputs, targets: [micro, seq_len]; sample_ids: micro entries (the sampler's sample index of each row).
  virtual Status Fetch(int64_t step, int mb, int32_t* inputs, int32_t* targets, int64_t* sample_ids) = 0;
  // Data preparation done by this rank (reading, converting, copying out of the ring) and, for the host's
  // loader, the loader thread's: CPU seconds and bytes read from the dataset.
  struct Stats {
    double cpu_s = 0;
    int64_t dataset_bytes = 0;
    int64_t segment_bytes = 0;  // the shared ring's size (the loader's rank only)
    int64_t memory_bytes = 0;   // host memory for data: the ring, private copies, the sampler's permutations
  };
  virtual Stats stats() const = 0;
};

// The batch source of this rank for data.loader. needs_tokens: this rank computes an embedding or a
// head chunk. The shared loader is created by local rank 0 (which starts its thread) and attached to
// by the others; a rank that needs no tokens gets a source whose Fetch fails (it must not be called).
Result<std::unique_ptr<BatchSource>> MakeBatchSource(const config::JobSpec& spec, const Runtime& rt,
                                                     const data::Sampler& sampler, const DataPosition& pos,
                                                     bool needs_tokens);

// The /dev/shm name prefix of this user's loader segments for the job writing to run_dir.
std::string LoaderSegmentPrefix(const std::string& run_dir);
// Removes this user's loader segments of the job writing to run_dir whose name is not `keep`
// (of host `host_index` only, when >= 0: hosts may share /dev/shm in a test cluster); returns how
// many were removed.
int RemoveLoaderSegments(const std::string& run_dir, const std::string& keep = "", int host_index = -1);

}  // namespace ms::runner
