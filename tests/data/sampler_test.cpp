// Sampler: determinism, epoch coverage, train/valid split, errors, concurrent use.
#include <doctest/doctest.h>

#include <numeric>
#include <set>
#include <thread>

#include "data/data.h"
#include "data/test_util.h"

namespace ms::data {
namespace {

using testing::TempDir;

// A dataset whose token stream is 0, 1, 2, ..., n-1 (token = its own position), cut into
// documents of random lengths (some empty): sample contents then reveal where they came from.
void WritePositionDataset(const std::string& prefix, int64_t n, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<int32_t>> docs;
  int64_t pos = 0;
  while (pos < n) {
    int64_t len = std::min<int64_t>(n - pos, rng.NextBelow(40));
    docs.emplace_back(len);
    std::iota(docs.back().begin(), docs.back().end(), static_cast<int32_t>(pos));
    pos += len;
  }
  REQUIRE(WriteIndexedDataset(prefix, docs, 100003).ok());
}

}  // namespace

TEST_CASE("sampler: split sizes and sample contents") {
  TempDir dir;
  const int64_t n = 5003;
  WritePositionDataset(dir / "pos", n, 5);
  auto ds = IndexedDataset::Open(dir / "pos");
  REQUIRE(ds.ok());
  REQUIRE(ds->num_tokens() == n);
  for (int T : {1, 7, 64, 129}) {
    for (double f : {0.0, 0.01, 0.1, 0.5}) {
      CAPTURE(T);
      CAPTURE(f);
      auto s = Sampler::Create(&*ds, T, f, 42);
      REQUIRE_MESSAGE(s.ok(), s.status().ToString());
      const int64_t samples = (n - 1) / T;
      const int64_t valid = f > 0 ? std::max<int64_t>(1, static_cast<int64_t>(samples * f)) : 0;
      CHECK(s->num_valid() == valid);
      CHECK(s->num_train() == samples - valid);
      CHECK(s->seq_len() == T);
      std::vector<int32_t> out(T + 2, -1);
      // Train samples hold T+1 consecutive stream tokens starting at a multiple of T below the split.
      for (int64_t k = 0; k < 50; ++k) {
        REQUIRE(s->GetTrain(k * 7919, out.data()).ok());
        CHECK(out[0] % T == 0);
        CHECK(out[0] / T < s->num_train());
        for (int t = 0; t <= T; ++t) CHECK(out[t] == out[0] + t);
        CHECK(out[T + 1] == -1);
      }
      // Validation samples: in order, after the train split, k modulo num_valid.
      if (valid > 0) {
        for (int64_t k = 0; k < 2 * valid + 3; ++k) {
          REQUIRE(s->GetValid(k, out.data()).ok());
          CHECK(out[0] == (s->num_train() + k % valid) * T);
          for (int t = 0; t <= T; ++t) CHECK(out[t] == out[0] + t);
        }
      } else {
        CHECK(s->GetValid(0, out.data()).code() == Code::kFailedPrecondition);
      }
      CHECK(s->GetTrain(-1, out.data()).code() == Code::kOutOfRange);
      CHECK(s->GetValid(-1, out.data()).code() == Code::kOutOfRange);
      CHECK(s->TrainSampleIndex(-5).status().code() == Code::kOutOfRange);
    }
  }
}

TEST_CASE("sampler: each epoch visits every train sample once, in a new seeded order") {
  TempDir dir;
  WritePositionDataset(dir / "pos", 4099, 6);
  auto ds = IndexedDataset::Open(dir / "pos");
  REQUIRE(ds.ok());
  const int T = 31;
  auto s = Sampler::Create(&*ds, T, 0.05, 1234);
  REQUIRE(s.ok());
  const int64_t nt = s->num_train();
  std::vector<std::vector<int64_t>> orders;
  std::vector<int32_t> out(T + 1);
  for (int64_t e = 0; e < 4; ++e) {
    std::vector<int64_t> order;
    std::vector<int> seen(nt, 0);
    for (int64_t i = 0; i < nt; ++i) {
      auto j = s->TrainSampleIndex(e * nt + i);
      REQUIRE(j.ok());
      REQUIRE((*j >= 0 && *j < nt));  // never a validation sample
      ++seen[*j];
      order.push_back(*j);
      if (i % 17 == 0) {
        REQUIRE(s->GetTrain(e * nt + i, out.data()).ok());
        CHECK(out[0] == *j * T);
      }
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    orders.push_back(order);
  }
  for (size_t a = 0; a < orders.size(); ++a) {
    for (size_t b = a + 1; b < orders.size(); ++b) CHECK(orders[a] != orders[b]);
  }
  std::vector<int64_t> identity(nt);
  std::iota(identity.begin(), identity.end(), int64_t{0});
  CHECK(orders[0] != identity);

  // The order is exactly the documented Fisher-Yates with Rng(seed, epoch): pinned so that a
  // checkpoint taken by one version resumes the same data order in the next.
  for (int64_t e : {0, 3}) {
    std::vector<int64_t> perm = identity;
    Rng rng(1234, e);
    for (int64_t j = nt - 1; j > 0; --j) std::swap(perm[j], perm[rng.NextBelow(j + 1)]);
    CHECK(perm == orders[e]);
  }
}

TEST_CASE("sampler: same (seed, k) gives the same sample in any query order; other seeds differ") {
  TempDir dir;
  WritePositionDataset(dir / "pos", 3001, 7);
  auto ds = IndexedDataset::Open(dir / "pos");
  REQUIRE(ds.ok());
  auto a = Sampler::Create(&*ds, 16, 0.1, 77);
  auto b = Sampler::Create(&*ds, 16, 0.1, 77);
  auto c = Sampler::Create(&*ds, 16, 0.1, 78);
  REQUIRE((a.ok() && b.ok() && c.ok()));
  Rng rng(3);
  std::vector<int64_t> ks(500);
  for (auto& k : ks) k = rng.NextBelow(a->num_train() * 9);
  std::vector<int64_t> first;
  for (int64_t k : ks) first.push_back(*a->TrainSampleIndex(k));
  // b is queried in reverse (epochs jump around, the cache is evicted over and over).
  int differs = 0;
  for (size_t i = ks.size(); i-- > 0;) {
    CHECK(*b->TrainSampleIndex(ks[i]) == first[i]);
    differs += *c->TrainSampleIndex(ks[i]) != first[i];
  }
  CHECK(differs > 400);
  // A moved sampler keeps working.
  Sampler moved = std::move(*a);
  CHECK(*moved.TrainSampleIndex(ks[0]) == first[0]);
}

TEST_CASE("sampler: concurrent readers agree with a serial run") {
  TempDir dir;
  WritePositionDataset(dir / "pos", 2003, 8);
  auto ds = IndexedDataset::Open(dir / "pos");
  REQUIRE(ds.ok());
  auto s = Sampler::Create(&*ds, 8, 0.0, 5);
  REQUIRE(s.ok());
  const int64_t total = s->num_train() * 6;  // six epochs: threads cross boundaries at different times
  std::vector<int64_t> serial(total);
  {
    auto ref = Sampler::Create(&*ds, 8, 0.0, 5);
    REQUIRE(ref.ok());
    for (int64_t k = 0; k < total; ++k) serial[k] = *ref->TrainSampleIndex(k);
  }
  std::vector<int64_t> got(total, -1);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<int32_t> out(9);
      for (int64_t k = t; k < total; k += 4) {
        got[k] = s->GetTrain(k, out.data()).ok() ? out[0] / 8 : -2;
      }
    });
  }
  for (auto& th : threads) th.join();
  CHECK(got == serial);
}

TEST_CASE("sampler: too few tokens and bad arguments are InvalidArgument naming the numbers") {
  TempDir dir;
  REQUIRE(WriteIndexedDataset(dir / "tiny", {{1, 2, 3, 4}, {}, {5, 6, 7, 8, 9, 10}}, 256).ok());
  auto ds = IndexedDataset::Open(dir / "tiny");
  REQUIRE(ds.ok());
  REQUIRE(ds->num_tokens() == 10);
  // 10 tokens, seq_len 9: one sample of 10 tokens.
  auto one = Sampler::Create(&*ds, 9, 0.0, 1);
  REQUIRE(one.ok());
  CHECK(one->num_train() == 1);
  std::vector<int32_t> out(10);
  REQUIRE(one->GetTrain(5, out.data()).ok());  // epoch 5, the only sample
  CHECK(out == std::vector<int32_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10});

  auto with_valid = Sampler::Create(&*ds, 9, 0.1, 1);
  REQUIRE_FALSE(with_valid.ok());
  CHECK(with_valid.status().code() == Code::kInvalidArgument);
  for (const char* needle : {"10 tokens", "1 samples", "valid", "at least 19 tokens"}) {
    INFO(with_valid.status().message());
    CHECK(with_valid.status().message().find(needle) != std::string::npos);
  }
  auto two_valid = Sampler::Create(&*ds, 4, 0.1, 1);  // 2 samples: 1 train + 1 valid
  REQUIRE(two_valid.ok());
  CHECK(two_valid->num_train() == 1);
  CHECK(two_valid->num_valid() == 1);
  auto too_long = Sampler::Create(&*ds, 10, 0.0, 1);
  REQUIRE_FALSE(too_long.ok());
  CHECK(too_long.status().message().find("0 samples") != std::string::npos);

  CHECK(Sampler::Create(&*ds, 0, 0.0, 1).status().code() == Code::kInvalidArgument);
  CHECK(Sampler::Create(&*ds, 2, 1.0, 1).status().code() == Code::kInvalidArgument);
  CHECK(Sampler::Create(&*ds, 2, -0.5, 1).status().code() == Code::kInvalidArgument);
  CHECK(Sampler::Create(&*ds, 2, std::nan(""), 1).status().code() == Code::kInvalidArgument);
  CHECK(Sampler::Create(nullptr, 2, 0.0, 1).status().code() == Code::kInvalidArgument);
}

}  // namespace ms::data
