#include <doctest/doctest.h>

#include <unistd.h>

#include "core/core.h"

namespace ms {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgument("{} is odd", x);
  return x / 2;
}
Result<int> Quarter(int x) {
  MS_ASSIGN_OR_RETURN(int h, Half(x));
  MS_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}
Status CheckQuarter(int x) {
  MS_RETURN_IF_ERROR_CTX(Quarter(x).status(), "quartering {}", x);
  return Status::Ok();
}

TEST_CASE("status and result carry errors with context") {
  CHECK(Quarter(8).ok());
  CHECK(*Quarter(8) == 2);
  auto r = Quarter(6);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kInvalidArgument);
  CHECK(r.status().message() == "3 is odd");
  Status s = CheckQuarter(6);
  CHECK(s.message() == "quartering 6: 3 is odd");
  CHECK(s.ToString() == "InvalidArgument: quartering 6: 3 is odd");
  CHECK(CheckQuarter(4).ok());
  Result<int> bad{Status::Ok()};
  CHECK(bad.status().code() == Code::kInternal);
}

TEST_CASE("rng is deterministic and resumable") {
  Rng a(42, 1), b(42, 1), c(42, 2);
  for (int i = 0; i < 5; ++i) {
    uint64_t x = a.NextU64();
    CHECK(x == b.NextU64());
    CHECK(x != c.NextU64());
  }
  a.NextNormal();
  auto st = a.State();
  double n1 = a.NextNormal(), n2 = a.NextNormal();
  Rng d(0);
  d.SetState(st);
  CHECK(d.NextNormal() == n1);
  CHECK(d.NextNormal() == n2);
  double sum = 0, sq = 0;
  Rng e(7);
  for (int i = 0; i < 20000; ++i) {
    double v = e.NextNormal();
    sum += v;
    sq += v * v;
  }
  CHECK(std::abs(sum / 20000) < 0.05);
  CHECK(std::abs(sq / 20000 - 1.0) < 0.05);
  for (int i = 0; i < 1000; ++i) CHECK(e.NextBelow(7) < 7);
}

TEST_CASE("atomic write replaces a file whole") {
  std::string dir = fmt::format("/tmp/ms_core_test_{}", getpid());
  REQUIRE(MakeDirs(dir + "/a/b").ok());
  std::string path = dir + "/a/b/f.txt";
  REQUIRE(WriteFileAtomic(path, "hello").ok());
  REQUIRE(WriteFileAtomic(path, "world!").ok());
  auto r = ReadFile(path);
  REQUIRE(r.ok());
  CHECK(*r == "world!");
  CHECK(access((path + ".tmp").c_str(), F_OK) != 0);
  auto missing = ReadFile(dir + "/nope");
  CHECK(missing.status().code() == Code::kNotFound);
  CHECK(WriteFileAtomic("/proc/definitely/not/here", "x").code() != Code::kOk);
  REQUIRE(system(fmt::format("rm -rf {}", dir).c_str()) == 0);
}

}  // namespace ms
