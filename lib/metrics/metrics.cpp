#include "metrics/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <vector>

#include "ops/ops.h"

namespace ms::metrics {

double MeasureGemmPeakFlops(int n) {
  std::vector<float> a(static_cast<size_t>(n) * n), b(a.size()), c(a.size());
  Rng rng(1);
  for (auto& x : a) x = static_cast<float>(rng.NextDouble() - 0.5);
  for (auto& x : b) x = static_cast<float>(rng.NextDouble() - 0.5);
  ops::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);  // warm-up
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = NowSeconds();
    ops::Gemm(false, false, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    double dt = NowSeconds() - t0;
    if (dt > 0) best = std::max(best, 2.0 * n * n * static_cast<double>(n) / dt);
  }
  return best;
}

void JsonObject::Key(std::string_view key) {
  if (!body_.empty()) body_ += ", ";
  body_.push_back('"');
  body_.append(JsonEscape(key));
  body_.append("\": ");
}
JsonObject& JsonObject::Add(std::string_view key, double v) {
  Key(key);
  body_ += std::isfinite(v) ? fmt::format("{:.9g}", v) : std::string("null");
  return *this;
}
JsonObject& JsonObject::AddTime(std::string_view key, double unix_seconds) {
  Key(key);
  body_ += fmt::format("{:.3f}", unix_seconds);
  return *this;
}
JsonObject& JsonObject::Add(std::string_view key, int64_t v) {
  Key(key);
  body_ += fmt::format("{}", v);
  return *this;
}
JsonObject& JsonObject::Add(std::string_view key, std::string_view v) {
  Key(key);
  body_.push_back('"');
  body_.append(JsonEscape(v));
  body_.push_back('"');
  return *this;
}

Result<JsonlWriter> JsonlWriter::Open(const std::string& path, bool append) {
  FILE* f = std::fopen(path.c_str(), append ? "a" : "w");
  if (!f) return ErrnoError(fmt::format("opening {}", path), errno);
  return JsonlWriter(f, path);
}
JsonlWriter::~JsonlWriter() {
  if (f_) std::fclose(f_);
}
Status JsonlWriter::Write(const JsonObject& obj) {
  std::string line = obj.str() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), f_) != line.size() || std::fflush(f_) != 0) {
    return ErrnoError(fmt::format("writing {}", path_), errno);
  }
  return Status::Ok();
}

Progress::Progress(FILE* out, int64_t total_steps, int interval)
    : out_(out), total_(total_steps), interval_(std::max(1, interval)), tty_(isatty(fileno(out)) != 0) {}

std::string Progress::FormatDuration(double s) {
  if (!std::isfinite(s) || s < 0) return "?";
  int64_t t = static_cast<int64_t>(std::llround(s));
  if (t >= 3600) return fmt::format("{}h{:02}m", t / 3600, (t % 3600) / 60);
  if (t >= 60) return fmt::format("{}m{:02}s", t / 60, t % 60);
  return fmt::format("{}s", t);
}

void Progress::Update(int64_t step, double loss, double tps, double mfu, double sps) {
  std::string tok = tps >= 1e6 ? fmt::format("{:.2f}M", tps / 1e6) : fmt::format("{:.1f}k", tps / 1e3);
  std::string line = fmt::format("step {}/{} | loss {:.4f} | {} tok/s | MFU {:.1f}% | ETA {}", step, total_, loss, tok,
                                 mfu * 100, FormatDuration(sps * static_cast<double>(total_ - step)));
  if (tty_) {
    fmt::print(out_, "\r\033[K{}", line);
    std::fflush(out_);
    dirty_ = true;
  } else if (step % interval_ == 0 || step == total_ || step == 1) {
    fmt::print(out_, "{}\n", line);
    std::fflush(out_);
  }
}

void Progress::Message(std::string_view line) {
  if (tty_ && dirty_) fmt::print(out_, "\r\033[K");
  fmt::print(out_, "{}\n", line);
  std::fflush(out_);
  dirty_ = false;
}

void Progress::Finish() {
  if (tty_ && dirty_) fmt::print(out_, "\n");
  std::fflush(out_);
  dirty_ = false;
}

void Trace::Span(std::string_view name, std::string_view lane, double start, double end) {
  if (!enabled_) return;
  size_t tid = 0;
  while (tid < lanes_.size() && lanes_[tid] != lane) ++tid;
  if (tid == lanes_.size()) lanes_.emplace_back(lane);
  events_.push_back(fmt::format(R"({{"name": "{}", "ph": "X", "pid": {}, "tid": {}, "ts": {:.3f}, "dur": {:.3f}}})",
                                JsonEscape(name), rank_, tid, (start - origin_) * 1e6,
                                std::max(0.0, end - start) * 1e6));
}

Status Trace::Write(const std::string& path) const {
  std::string out = "[\n";
  out +=
      fmt::format(R"({{"name": "process_name", "ph": "M", "pid": {}, "args": {{"name": "rank {}"}}}})", rank_, rank_);
  out += fmt::format(",\n{{\"name\": \"clock_origin\", \"ph\": \"M\", \"pid\": {}, \"args\": {{\"unix_s\": {:.6f}}}}}",
                     rank_, origin_unix_);
  for (size_t t = 0; t < lanes_.size(); ++t) {
    out += fmt::format(
        ",\n{{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": {}, \"tid\": {}, "
        "\"args\": {{\"name\": \"{}\"}}}}",
        rank_, t, JsonEscape(lanes_[t]));
  }
  for (const auto& e : events_) {
    out += ",\n";
    out += e;
  }
  out += "\n]\n";
  return WriteFileAtomic(path, out);
}

}  // namespace ms::metrics
