// Metrics: FLOP accounting and MFU, the per-step JSONL log, and the progress display.
//
// MFU = achieved model FLOP/s / peak FLOP/s, where model FLOPs count only the work the
// model needs (model::TrainingFlopsPerSequence; no recomputation, no optimizer), and the
// peak is either configured (log.peak_flops) or measured here as the best fp32 GEMM rate
// of this machine (MeasureGemmPeakFlops).
#pragma once

#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "core/core.h"

namespace ms::metrics {

// Best-of-3 rate of a square fp32 GEMM of size n through ops::Gemm with the current OpenMP
// thread count, in FLOP/s. Takes about 0.2-1 s.
double MeasureGemmPeakFlops(int n = 1024);

// A flat JSON object built field by field: {"step": 3, "loss": 2.5, "phase": "train"}.
class JsonObject {
 public:
  JsonObject& Add(std::string_view key, double v);
  JsonObject& Add(std::string_view key, int64_t v);
  JsonObject& Add(std::string_view key, int v) { return Add(key, static_cast<int64_t>(v)); }
  JsonObject& Add(std::string_view key, std::string_view v);
  JsonObject& Add(std::string_view key, const char* v) { return Add(key, std::string_view(v)); }
  // A wall-clock time in seconds since the epoch, to the millisecond (Add(double) keeps 9 digits: 10 s).
  JsonObject& AddTime(std::string_view key, double unix_seconds);
  std::string str() const { return "{" + body_ + "}"; }

 private:
  void Key(std::string_view key);
  std::string body_;
};

// Appends one JSON object per line, flushed after each line (a crash loses at most the line
// being written). Not thread-safe.
class JsonlWriter {
 public:
  static Result<JsonlWriter> Open(const std::string& path, bool append);
  JsonlWriter(JsonlWriter&& o) noexcept : f_(std::exchange(o.f_, nullptr)), path_(std::move(o.path_)) {}
  JsonlWriter& operator=(JsonlWriter&&) = delete;
  ~JsonlWriter();
  Status Write(const JsonObject& obj);

 private:
  JsonlWriter(FILE* f, std::string path) : f_(f), path_(std::move(path)) {}
  FILE* f_;
  std::string path_;
};

// One-line progress on a terminal ("step 120/300 | loss 2.41 | 8.1k tok/s | MFU 31% | ETA 1m05s",
// rewritten in place); plain lines every `interval` steps when the stream is not a terminal.
class Progress {
 public:
  Progress(FILE* out, int64_t total_steps, int interval);
  void Update(int64_t step, double loss, double tokens_per_s, double mfu, double seconds_per_step);
  // Prints a line that must not be overwritten (eval results, warnings) above the progress line.
  void Message(std::string_view line);
  void Finish();
  static std::string FormatDuration(double seconds);

 private:
  FILE* out_;
  int64_t total_;
  int interval_;
  bool tty_;
  bool dirty_ = false;
};

// Chrome trace (the JSON array format Perfetto and chrome://tracing open): complete spans
// ("ph": "X") with microsecond timestamps, one "thread" per lane (compute, dp, pp, tp).
// Not thread-safe: spans are added by the training thread.
class Trace {
 public:
  explicit Trace(int rank) : rank_(rank), origin_(NowSeconds()), origin_unix_(WallSeconds()) {}
  bool enabled() const { return enabled_; }
  void set_enabled(bool e) { enabled_ = e; }
  // start/end from NowSeconds().
  void Span(std::string_view name, std::string_view lane, double start, double end);
  Status Write(const std::string& path) const;

 private:
  int rank_;
  double origin_;
  double origin_unix_;  // wall clock of ts 0, written as metadata: traces of several ranks line up on it
  bool enabled_ = false;
  std::vector<std::string> events_;
  std::vector<std::string> lanes_;
};

}  // namespace ms::metrics
