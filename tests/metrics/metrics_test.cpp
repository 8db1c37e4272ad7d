#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <string>

#include "metrics/metrics.h"

namespace ms::metrics {

TEST_CASE("json objects escape strings and write non-finite numbers as null") {
  JsonObject o;
  o.Add("phase", "tr\"ain\n").Add("step", int64_t{3}).Add("loss", 2.5).Add("bad", 0.0 / 0.0);
  CHECK(o.str() == R"({"phase": "tr\"ain\n", "step": 3, "loss": 2.5, "bad": null})");
  CHECK(JsonEscape(std::string("a\x01z")) == "a\\u0001z");
}

TEST_CASE("jsonl writer appends one line per object") {
  std::string path = fmt::format("/tmp/ms_metrics_test_{}.jsonl", getpid());
  {
    auto w = JsonlWriter::Open(path, false);
    REQUIRE(w.ok());
    REQUIRE(w->Write(JsonObject().Add("a", 1)).ok());
    REQUIRE(w->Write(JsonObject().Add("b", 2)).ok());
  }
  auto text = ReadFile(path);
  REQUIRE(text.ok());
  CHECK(*text == "{\"a\": 1}\n{\"b\": 2}\n");
  std::remove(path.c_str());
  CHECK_FALSE(JsonlWriter::Open("/nonexistent-dir/x.jsonl", false).ok());
}

TEST_CASE("progress prints plain lines at the interval when not a terminal") {
  std::string path = fmt::format("/tmp/ms_progress_test_{}.txt", getpid());
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f);
  Progress p(f, 10, 4);
  for (int s = 1; s <= 10; ++s) p.Update(s, 3.0, 12345, 0.5, 0.1);
  p.Message("step 10: validation loss 2.0000");
  p.Finish();
  std::fclose(f);
  std::string text = *ReadFile(path);
  CHECK(text.find("step 1/10") != std::string::npos);
  CHECK(text.find("step 4/10") != std::string::npos);
  CHECK(text.find("step 8/10") != std::string::npos);
  CHECK(text.find("step 10/10") != std::string::npos);
  CHECK(text.find("step 3/10") == std::string::npos);
  CHECK(text.find("12.3k tok/s") != std::string::npos);
  CHECK(text.find("MFU 50.0%") != std::string::npos);
  CHECK(text.find('\r') == std::string::npos);
  std::remove(path.c_str());
  CHECK(Progress::FormatDuration(59) == "59s");
  CHECK(Progress::FormatDuration(65) == "1m05s");
  CHECK(Progress::FormatDuration(3725) == "1h02m");
}

TEST_CASE("gemm peak measurement returns a plausible rate") {
  double peak = MeasureGemmPeakFlops(128);
  CHECK(peak > 1e8);
  CHECK(peak < 1e14);
}

}  // namespace ms::metrics
