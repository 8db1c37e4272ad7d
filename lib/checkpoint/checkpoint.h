// Checkpoints: asynchronous two-stage save, validation on load, resharding to another
// parallel layout, and export of the parameters as safetensors. Format: docs/checkpoints.md.
//
// Unit of saving: a PIECE, the contiguous element range [begin, end) (row-major) of the
// tensor-parallel shard of one global tensor, of one kind ("param", "exp_avg", "exp_avg_sq",
// or any other name). The shard is described by (global_shape, ShardKind, tp_size, tp_rank)
// exactly as model::ExtractShard cuts it. Under ZeRO a rank holds only ranges of a shard;
// replicas may be saved by one rank or many: the loader only needs every element of every
// (kind, tensor) covered by some piece, and says which tensor is not.
//
// Saving (one AsyncCheckpointer per rank):
//   stage 1, Snapshot(): validates the pieces and copies them into host memory owned by the
//     checkpointer. This is the only part that blocks training; its duration is returned.
//   stage 2, a background thread: writes <dir>/step-NNNNNNNN/rank-RRRRR.bin (header, JSON
//     index, 4 KiB-aligned data; CRC32C per file and per piece) via a temp name, fsyncs the
//     file and the directory, tells the Coordinator it is durable. Rank 0 waits until every
//     rank's file is durable, then commits manifest.json atomically (temp, fsync, rename,
//     fsync dir) and applies retention. Only a step directory with a valid manifest is a
//     checkpoint; a crash at any moment leaves the previous checkpoints intact.
//   Overlap: when a snapshot is requested while the previous one is still being written, the
//     policy chosen at construction applies (kWait: block until it is written; kSkip: drop
//     the new one and tell the coordinator, so rank 0 does not wait for it) and is logged.
//   Failure: nothing is thrown; a failed write (disk full, I/O error, a rank that failed or
//     timed out) removes the partial files (rank 0: the whole step directory) and never
//     leaves a manifest; the error is logged, kept in LastError() and returned by Wait().
//   Retention (rank 0, after each commit, keep > 0): deletes complete checkpoints older than
//     the newest `keep`, and incomplete step directories older than the newest complete one;
//     never the newest complete one, never a newer incomplete one (it may be being written).
//     A directory is deleted manifest first, so a half-deleted one is never taken as valid.
//
// Loading: FindLatestValid() scans step-* newest first and returns the first checkpoint whose
// manifest parses and whose files have the recorded size and CRC32C; each rejected newer one
// is logged with LogWarn naming the problem. Checkpoint::Read() fills any target shard/range
// from whatever layout saved it (tp, pp, dp may all differ), checking every piece's CRC32C.
//
// Thread safety: AsyncCheckpointer's methods are called from one thread (the training loop);
// the background writer is internal. Checkpoint is safe to Read() from several threads.
// InProcessCoordinator is thread-safe. Coordinator implementations must be thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"
#include "model/model.h"

namespace ms::checkpoint {

// ---- pieces and files --------------------------------------------------------------------

// One piece to save. `data` points at end - begin floats, owned by the caller, which must
// stay unchanged only until Snapshot() returns.
struct PieceRef {
  std::string tensor;                 // e.g. "layers.3.attn.qkv.weight" (the model's names)
  std::string kind;                   // "param", "exp_avg", "exp_avg_sq", ...
  std::vector<int64_t> global_shape;  // full tensor, 1-D or 2-D (N-D: rows = dim 0)
  model::ShardKind shard = model::ShardKind::kReplicated;
  int tp_size = 1, tp_rank = 0;
  int64_t begin = 0, end = 0;  // element range of the TP-local shard, row-major
  const float* data = nullptr;
};

// What to read: a range of one TP shard of a global tensor (end = -1: to the end of the shard).
struct ShardTarget {
  std::vector<int64_t> global_shape;
  model::ShardKind shard = model::ShardKind::kReplicated;
  int tp_size = 1, tp_rank = 0;
  int64_t begin = 0, end = -1;
};

// A saved piece, as recorded in a rank file's index and in the manifest.
struct PieceInfo {
  std::string tensor, kind;
  std::vector<int64_t> global_shape;
  model::ShardKind shard = model::ShardKind::kReplicated;
  int tp_size = 1, tp_rank = 0;
  int64_t begin = 0, end = 0;
  int64_t offset = 0;   // byte offset of the data in the rank file (little-endian fp32)
  uint32_t crc32c = 0;  // of the piece's bytes
};

// One durable rank file: what a rank reports to the coordinator and the manifest lists.
struct FileInfo {
  int rank = 0;
  std::string name;      // "rank-RRRRR.bin", relative to the step directory
  int64_t size = 0;      // bytes
  uint32_t crc32c = 0;   // of the whole file
  std::string metadata;  // the rank's metadata blob (step, samples, RNG states, ...), opaque
  std::vector<PieceInfo> pieces;

  // Compact JSON, and back: for coordinators that pass FileInfo through a key-value store.
  std::string ToJson() const;
  static Result<FileInfo> FromJson(std::string_view json);
};

struct Layout {
  int tp = 1, pp = 1, dp = 1;
  int world() const { return tp * pp * dp; }
};

// ---- coordination ------------------------------------------------------------------------

// How rank 0 learns that every rank's file of a step is durable. The in-process version below
// serves tests and single-process runs; a multi-process job implements it over its store.
// Every method may be called from any rank's writer or training thread; implementations are thread-safe.
class Coordinator {
 public:
  virtual ~Coordinator() = default;
  // Called by each rank's training thread when it hands `step` to its writer (AsyncCheckpointer::Snapshot, before
  // any other call for it; not for a skipped step): before the rank's next training step, so that every rank's
  // marks of a later checkpoint follow it (a store coordinator tells from it whether its server was restarted since).
  virtual Status BeginStep(int64_t /*step*/) { return Status::Ok(); }
  // Called by each rank once its file for `step` is durable.
  virtual Status MarkDurable(int64_t step, int rank, const FileInfo& info) = 0;
  // Called by a rank that will not provide a file for `step` (write failed, or skipped).
  virtual Status MarkFailed(int64_t step, int rank, const Status& why) = 0;
  // Rank 0: blocks until every rank in [0, world) marked `step` durable and returns their
  // FileInfos ordered by rank; returns the error of the first rank that failed, or Timeout
  // naming the ranks still missing after timeout_s. Forgets `step` afterwards.
  virtual Result<std::vector<FileInfo>> WaitAllDurable(int64_t step, int world, double timeout_s) = 0;
};

class InProcessCoordinator final : public Coordinator {
 public:
  InProcessCoordinator();
  ~InProcessCoordinator() override;
  InProcessCoordinator(const InProcessCoordinator&) = delete;
  InProcessCoordinator& operator=(const InProcessCoordinator&) = delete;

  Status MarkDurable(int64_t step, int rank, const FileInfo& info) override;
  Status MarkFailed(int64_t step, int rank, const Status& why) override;
  Result<std::vector<FileInfo>> WaitAllDurable(int64_t step, int world, double timeout_s) override;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// ---- saving ------------------------------------------------------------------------------

enum class OverlapPolicy {
  kWait,  // a new snapshot waits for the previous write to finish (training blocks)
  kSkip,  // a new snapshot is dropped while the previous one is still being written
};

struct CheckpointerOptions {
  std::string dir{};  // checkpoint root, e.g. <run_dir>/checkpoints (created if missing)
  int rank = 0;       // this rank, in [0, layout.world())
  Layout layout{};    // the saving layout; world = tp * pp * dp ranks write one file each
  OverlapPolicy policy = OverlapPolicy::kWait;
  int keep = 2;                         // complete checkpoints kept by retention; 0 = keep all
  double coordination_timeout_s = 600;  // rank 0's wait for the other ranks' files
  size_t write_chunk_bytes = 8 << 20;   // write() size; the CRC runs on each chunk just before
  bool direct_io = true;                // O_DIRECT data writes where the file system allows it
  size_t reserve_bytes = 0;             // host memory for snapshots allocated and faulted in at
                                        // Create (else at the first Snapshot, which then pays
                                        // the page faults); grows when a snapshot needs more
  // Fault injection for tests: called by the writer thread at "write" (before the rank file is
  // opened), "durable" (file durable, before coordination) and "manifest" (rank 0, before the
  // manifest is committed). Empty: none.
  std::function<void(std::string_view stage, int64_t step)> fault_hook{};
};

struct SnapshotInfo {
  bool skipped = false;        // dropped by OverlapPolicy::kSkip
  double blocked_seconds = 0;  // time Snapshot() held the caller (waiting + copying)
  double wait_seconds = 0;     // of which waiting for the previous write (kWait)
  int64_t bytes = 0;           // payload copied
};

// The end of one background write (rank 0: the manifest committed, or not).
struct WriteOutcome {
  int64_t step = 0;
  Status status;       // OK: durable (rank 0: committed); else why not (files removed)
  double seconds = 0;  // the write, fsyncs and coordination
};

class AsyncCheckpointer {
 public:
  // Creates the root directory if needed and proves it writable (creates and removes a probe
  // file): an unwritable root is an error naming it, before any training step is spent.
  // `coordinator` is not owned and must outlive the checkpointer.
  static Result<std::unique_ptr<AsyncCheckpointer>> Create(CheckpointerOptions options, Coordinator* coordinator);
  // Drains: waits for the write in flight (errors are logged).
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Stage 1. Validates the pieces (shape, shard, range within the TP-local shard, non-null data)
  // and copies them; `metadata` is this rank's opaque blob (JSON or YAML text). Returns the time
  // training was blocked. InvalidArgument for a bad piece (nothing is started then). A failure
  // of an EARLIER background write does not fail Snapshot (see LastError()).
  Result<SnapshotInfo> Snapshot(int64_t step, const std::vector<PieceRef>& pieces, std::string metadata);
  // Waits until no write is pending; returns the first background error since the last Wait().
  Status Wait();
  // The most recent background error (OK if none ever).
  Status LastError() const;
  // Steps whose write completed on this rank (rank 0: manifest committed), in order.
  std::vector<int64_t> CompletedSteps() const;
  // The writes that ended (succeeded or failed) since the last call, in order: for a caller that
  // reports each checkpoint's fate while training goes on.
  std::vector<WriteOutcome> TakeOutcomes();
  // Seconds the last completed background write took (file write + fsync + coordination).
  double LastWriteSeconds() const;

 private:
  struct Impl;
  explicit AsyncCheckpointer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// "step-00000100" for step 100; the directory of one checkpoint under the root.
std::string StepDirName(int64_t step);
// "rank-00003.bin".
std::string RankFileName(int rank);

// ---- loading -----------------------------------------------------------------------------

enum class Verify {
  kFull,  // at open: every file's size and whole-file CRC32C (reads everything once)
  kLazy,  // at open: sizes only; each piece's CRC32C is checked when it is read
};

struct Manifest {
  int version = 0;
  int64_t step = 0;
  Layout layout;
  std::string created;          // ISO 8601 UTC
  std::vector<FileInfo> files;  // by rank
};

class Checkpoint {
 public:
  // Opens one step directory (must hold manifest.json) and verifies it as `verify` says.
  static Result<Checkpoint> Open(const std::string& step_dir, Verify verify = Verify::kFull);
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;
  ~Checkpoint();

  const std::string& dir() const;
  int64_t step() const;
  const Manifest& manifest() const;
  // Rank `rank`'s metadata blob (rank 0's by default); empty when out of range.
  const std::string& metadata(int rank = 0) const;
  // Kinds present, and tensors of one kind, sorted.
  std::vector<std::string> kinds() const;
  std::vector<std::string> tensors(const std::string& kind) const;
  // Global shape of a saved tensor; NotFound naming tensor and kind.
  Result<std::vector<int64_t>> GlobalShape(const std::string& kind, const std::string& tensor) const;

  // Fills `out` (target.end - target.begin floats) with the target range of the target TP shard,
  // reassembled from the saved pieces whatever layout saved them. Errors: NotFound (tensor or
  // kind not saved), InvalidArgument (global shape differs: names both shapes; bad target),
  // DataLoss (elements no piece covers; a piece's CRC32C or a short read). The reassembled
  // global tensor is cached, so each file region is read once; DropCache() frees the cache.
  Status Read(const std::string& kind, const std::string& tensor, const ShardTarget& target, float* out) const;
  // The whole global tensor (numel of its global shape floats).
  Status ReadGlobal(const std::string& kind, const std::string& tensor, float* out) const;
  void DropCache() const;
  // Frees the cached reassembly of one tensor of one kind (if any).
  void DropCache(const std::string& kind, const std::string& tensor) const;

 private:
  struct Impl;
  Checkpoint();
  std::unique_ptr<Impl> impl_;
};

// Scans root/step-* newest first and opens the first valid checkpoint. Every newer rejected
// one is logged (LogWarn) with its reason: missing manifest, unparsable manifest, missing
// file, truncated file, checksum mismatch. None valid: NotFound listing what was rejected.
// An I/O or permission error (Code::kIo) on the root or on a checkpoint stops the scan with that
// error instead of falling back to an older checkpoint.
// If `root` itself holds a manifest.json it is opened as a step directory.
Result<Checkpoint> FindLatestValid(const std::string& root, Verify verify = Verify::kFull);

// ---- export ------------------------------------------------------------------------------

// Writes every "param" tensor as a full global fp32 tensor to a safetensors file (names as in
// the checkpoint, sorted; __metadata__ holds format, step and source), atomically.
Status ExportSafetensors(const Checkpoint& checkpoint, const std::string& out_path);

// ---- helpers -----------------------------------------------------------------------------

// CRC32C (Castagnoli), continuing from `crc` (0 to start). SSE4.2 instruction when available.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
// Shape of one TP shard; InvalidArgument when the shape does not split that way.
Result<std::vector<int64_t>> LocalShape(const std::vector<int64_t>& global_shape, model::ShardKind shard, int tp_size);
std::string_view ShardKindName(model::ShardKind shard);  // "replicated", "rows", "cols", "qkv_rows"

}  // namespace ms::checkpoint
