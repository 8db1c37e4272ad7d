// Tests of the Gloo communicator: N in-process ranks (threads), each with its own TCP device and
// context on 127.0.0.1, rendezvous through a gloo HashStore (a FileStore across processes).
#include <doctest/doctest.h>
#include <gloo/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/hash_store.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"

namespace ms::comm {
namespace {

using Comms = std::vector<std::unique_ptr<Communicator>>;
using Millis = std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Connects `n` ranks through `store`, one thread per rank; contexts in rank order.
std::vector<std::shared_ptr<gloo::Context>> ConnectRanks(gloo::rendezvous::Store& store, int n, Millis timeout) {
  std::vector<std::shared_ptr<gloo::Context>> contexts(n);
  std::vector<Status> status(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto device = MakeGlooTcpDevice("127.0.0.1");
      if (!device.ok()) {
        status[r] = device.status();
        return;
      }
      auto context = ConnectGlooContext(store, r, n, *device, timeout, "test");
      if (!context.ok()) {
        status[r] = context.status();
        return;
      }
      contexts[r] = *context;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
  return contexts;
}

Comms MakeGroup(int n, Millis timeout = Millis(20'000)) {
  gloo::rendezvous::HashStore store;
  auto contexts = ConnectRanks(store, n, timeout);
  Comms comms;
  for (int r = 0; r < n; ++r) {
    comms.push_back(MakeGlooCommunicator(contexts[r], GlooOptions{timeout, fmt::format("test[{}]", r)}));
  }
  return comms;
}

// Runs fn(comm, rank) on one thread per rank. Assertions belong on the main thread: the
// functions record what they saw and the test checks it after the join.
void OnRanks(Comms& comms, const std::function<void(Communicator&, int)>& fn) {
  std::vector<std::thread> threads;
  for (size_t r = 0; r < comms.size(); ++r) threads.emplace_back([&, r] { fn(*comms[r], static_cast<int>(r)); });
  for (auto& t : threads) t.join();
}

// Seeded inputs with a spread of magnitudes, so that summation order would show.
std::vector<float> RandomFloats(int64_t n, uint64_t seed, uint64_t stream) {
  Rng rng(seed, stream);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = static_cast<float>(rng.NextNormal() * std::pow(10.0, rng.NextBelow(7)) * 1e-3);
  return v;
}

bool BitwiseEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

const int64_t kCounts[] = {1, 7, 1001, 100003};

TEST_CASE("gloo all-reduce: sum/max/min against the reference, bitwise equal on every rank and every run") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    CHECK(comms[1]->rank() == 1);
    CHECK(comms[1]->size() == n);
    CHECK(comms[1]->name() == "test[1]");
    for (int64_t count : kCounts) {
      CAPTURE(count);
      std::vector<std::vector<float>> in(n), sum(n), sum_again(n), max(n), min(n);
      for (int r = 0; r < n; ++r) in[r] = RandomFloats(count, 42, static_cast<uint64_t>(r));
      std::vector<Status> status(n);
      OnRanks(comms, [&](Communicator& c, int r) {
        sum[r] = in[r], sum_again[r] = in[r], max[r] = in[r], min[r] = in[r];
        // Issued back to back: the queue runs them in order while this thread waits.
        auto w1 = c.AllReduce(sum[r].data(), count, ReduceOp::kSum);
        auto w2 = c.AllReduce(max[r].data(), count, ReduceOp::kMax);
        auto w3 = c.AllReduce(min[r].data(), count, ReduceOp::kMin);
        auto w4 = c.AllReduce(sum_again[r].data(), count, ReduceOp::kSum);
        for (auto* w : {w4.get(), w3.get(), w2.get(), w1.get()}) {
          Status s = w->Wait();
          if (!s.ok()) status[r] = s;
        }
      });
      for (int r = 0; r < n; ++r) REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
      int bad_sum = 0, bad_max = 0, bad_min = 0;
      for (int64_t i = 0; i < count; ++i) {
        double ref = 0, abs_sum = 0;
        float ref_max = in[0][i], ref_min = in[0][i];
        for (int r = 0; r < n; ++r) {
          ref += in[r][i], abs_sum += std::fabs(in[r][i]);
          ref_max = std::max(ref_max, in[r][i]), ref_min = std::min(ref_min, in[r][i]);
        }
        bad_sum += std::fabs(sum[0][i] - ref) > 1e-6 * abs_sum + 1e-30;
        bad_max += max[0][i] != ref_max;
        bad_min += min[0][i] != ref_min;
      }
      CHECK(bad_sum == 0);
      CHECK(bad_max == 0);
      CHECK(bad_min == 0);
      for (int r = 0; r < n; ++r) {
        CAPTURE(r);
        CHECK(BitwiseEqual(sum[r], sum[0]));        // the same bits on every rank
        CHECK(BitwiseEqual(sum_again[r], sum[0]));  // and on a second run
        CHECK(BitwiseEqual(max[r], max[0]));
        CHECK(BitwiseEqual(min[r], min[0]));
      }
    }
  }
}

TEST_CASE("gloo all-reduce on doubles and int64 counters") {
  Comms comms = MakeGroup(3);
  std::vector<std::vector<double>> d(3);
  std::vector<std::vector<int64_t>> k(3);
  std::vector<Status> status(3);
  OnRanks(comms, [&](Communicator& c, int r) {
    d[r] = {0.1 * (r + 1), -1e300 * (r == 1), 3.0 + r};
    k[r] = {int64_t{1} << (40 + r), -r, 7};
    auto wd = c.AllReduce(d[r].data(), 3, ReduceOp::kSum);
    auto wk = c.AllReduce(k[r].data(), 2, ReduceOp::kSum);  // the third counter is left alone
    status[r] = wd->Wait();
    if (status[r].ok()) status[r] = wk->Wait();
  });
  for (int r = 0; r < 3; ++r) {
    REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
    CHECK(d[r][0] == doctest::Approx(0.6));
    CHECK(d[r][1] == -1e300);
    CHECK(d[r][2] == 12.0);
    CHECK(k[r][0] == (int64_t{1} << 40) + (int64_t{1} << 41) + (int64_t{1} << 42));
    CHECK(k[r][1] == -3);
    CHECK(k[r][2] == 7);
  }
}

TEST_CASE("gloo reduce-scatter and all-gather against the reference") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{1001}, int64_t{33335}}) {
      CAPTURE(count);
      std::vector<std::vector<float>> in(n), rs(n), ag(n), ag_in_place(n);
      std::vector<Status> status(n);
      for (int r = 0; r < n; ++r) in[r] = RandomFloats(count * n, 7, static_cast<uint64_t>(r));
      OnRanks(comms, [&](Communicator& c, int r) {
        rs[r].assign(count, -1.f);
        ag[r].assign(count * n, -1.f);
        ag_in_place[r].assign(count * n, -1.f);
        std::copy_n(in[r].begin(), count, ag_in_place[r].begin() + r * count);
        auto w1 = c.ReduceScatter(in[r].data(), rs[r].data(), count);
        auto w2 = c.AllGather(in[r].data(), ag[r].data(), count);  // the first `count` of the input
        auto w3 = c.AllGather(ag_in_place[r].data() + r * count, ag_in_place[r].data(), count);
        for (auto* w : {w1.get(), w2.get(), w3.get()}) {
          Status s = w->Wait();
          if (!s.ok()) status[r] = s;
        }
      });
      int bad_rs = 0, bad_ag = 0;
      for (int r = 0; r < n; ++r) {
        REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
        for (int64_t i = 0; i < count; ++i) {
          double ref = 0, abs_sum = 0;
          for (int q = 0; q < n; ++q) ref += in[q][r * count + i], abs_sum += std::fabs(in[q][r * count + i]);
          bad_rs += std::fabs(rs[r][i] - ref) > 1e-6 * abs_sum + 1e-30;
        }
        for (int q = 0; q < n; ++q) {
          for (int64_t i = 0; i < count; ++i) {
            bad_ag += ag[r][q * count + i] != in[q][i];
            bad_ag += ag_in_place[r][q * count + i] != in[q][i];
          }
        }
      }
      CHECK(bad_rs == 0);
      CHECK(bad_ag == 0);
    }
  }
}

TEST_CASE("gloo all-gather of 16-bit elements, out of place and in place, odd counts") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{40001}}) {
      CAPTURE(count);
      std::vector<std::vector<uint16_t>> in(n), ag(n), ag_in_place(n);
      std::vector<Status> status(n);
      for (int r = 0; r < n; ++r) {
        in[r].resize(count);  // every bit pattern class: a counter mixed with the rank, never the fill 0xFFFF
        for (int64_t i = 0; i < count; ++i) in[r][i] = static_cast<uint16_t>((i * 40503u + r * 7919u) % 65535u);
      }
      OnRanks(comms, [&](Communicator& c, int r) {
        ag[r].assign(count * n, 0xFFFF);
        ag_in_place[r].assign(count * n, 0xFFFF);
        std::copy_n(in[r].begin(), count, ag_in_place[r].begin() + r * count);
        auto w1 = c.AllGather16(in[r].data(), ag[r].data(), count);
        auto w2 = c.AllGather16(ag_in_place[r].data() + r * count, ag_in_place[r].data(), count);
        for (auto* w : {w1.get(), w2.get()}) {
          Status s = w->Wait();
          if (!s.ok()) status[r] = s;
        }
      });
      int bad = 0;
      for (int r = 0; r < n; ++r) {
        REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
        for (int q = 0; q < n; ++q) {
          for (int64_t i = 0; i < count; ++i) {
            bad += ag[r][q * count + i] != in[q][i];
            bad += ag_in_place[r][q * count + i] != in[q][i];
          }
        }
      }
      CHECK(bad == 0);
    }
  }
}

// bf16 sums: with 2 ranks every element is exactly round(a + b); with 3 the ring adds in some order per element, so
// each result must be one of the three orders' roundings (and the same on every rank for the all-reduce). Inputs:
// bf16 patterns of random values over several binades, negative and positive, so that sums round.
TEST_CASE("gloo bf16 all-reduce and reduce-scatter round every addition, odd counts") {
  auto add = [](uint16_t a, uint16_t b) { return FloatToBf16(Bf16ToFloat(a) + Bf16ToFloat(b)); };
  for (int n : {2, 3}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    for (int64_t count : {int64_t{1}, int64_t{7}, int64_t{40001}}) {
      CAPTURE(count);
      std::vector<std::vector<uint16_t>> in(n), ar(n), rs(n);
      std::vector<Status> status(n);
      for (int r = 0; r < n; ++r) {
        const std::vector<float> v = RandomFloats(count * n, 4242, static_cast<uint64_t>(r));
        in[r].resize(v.size());
        for (size_t i = 0; i < v.size(); ++i) in[r][i] = FloatToBf16(v[i] * std::ldexp(1.0f, static_cast<int>(i % 9)));
      }
      OnRanks(comms, [&](Communicator& c, int r) {
        ar[r] = in[r];
        rs[r].assign(count, 0xFFFF);
        auto w1 = c.AllReduce16(ar[r].data(), count * n);
        auto w2 = c.ReduceScatter16(in[r].data(), rs[r].data(), count);
        for (auto* w : {w1.get(), w2.get()}) {
          Status s = w->Wait();
          if (!s.ok()) status[r] = s;
        }
      });
      int bad_ar = 0, bad_rs = 0, differ = 0;
      auto allowed = [&](size_t i, uint16_t got) {
        if (n == 2) return got == add(in[0][i], in[1][i]);
        const uint16_t a = in[0][i], b = in[1][i], c = in[2][i];
        return got == add(add(a, b), c) || got == add(add(a, c), b) || got == add(add(b, c), a);
      };
      for (int r = 0; r < n; ++r) {
        REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
        for (int64_t i = 0; i < count * n; ++i) {
          bad_ar += !allowed(static_cast<size_t>(i), ar[r][i]);
          differ += ar[r][i] != ar[0][i];
        }
        for (int64_t i = 0; i < count; ++i) {
          bad_rs += !allowed(static_cast<size_t>(r * count + i), rs[r][i]);
        }
      }
      CHECK(bad_ar == 0);
      CHECK(bad_rs == 0);
      CHECK(differ == 0);
    }
  }
  // The rounding itself: a tie rounds to even, a NaN stays NaN, the largest finite value overflows to infinity.
  CHECK(FloatToBf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);      // tie, down to even
  CHECK(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);  // tie, up to even
  CHECK(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  CHECK(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::max()))));
}

TEST_CASE("gloo reduce-scatter is deterministic and rejects an overlapping output") {
  Comms comms = MakeGroup(3);
  const int64_t count = 5003;
  std::vector<std::vector<float>> in(3), a(3), b(3);
  std::vector<Status> status(3);
  for (int r = 0; r < 3; ++r) in[r] = RandomFloats(count * 3, 99, static_cast<uint64_t>(r));
  OnRanks(comms, [&](Communicator& c, int r) {
    a[r].assign(count, 0.f);
    b[r].assign(count, 0.f);
    auto w1 = c.ReduceScatter(in[r].data(), a[r].data(), count);
    auto w2 = c.ReduceScatter(in[r].data(), b[r].data(), count);
    status[r] = w1->Wait();
    if (status[r].ok()) status[r] = w2->Wait();
  });
  for (int r = 0; r < 3; ++r) {
    REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
    CHECK(BitwiseEqual(a[r], b[r]));
  }
  Status overlap = comms[0]->ReduceScatter(in[0].data(), in[0].data() + count, count)->Wait();
  CHECK(overlap.code() == Code::kInvalidArgument);
  CHECK(overlap.message().find("overlaps") != std::string::npos);
}

TEST_CASE("gloo broadcast from every root, and barrier") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    const int64_t count = 1001;
    std::vector<std::vector<std::vector<float>>> got(n);
    std::vector<Status> status(n);
    OnRanks(comms, [&](Communicator& c, int r) {
      std::vector<std::unique_ptr<Work>> works;
      got[r].resize(n);
      for (int root = 0; root < n; ++root) {
        got[r][root] = r == root ? RandomFloats(count, 5, root) : std::vector<float>(count, -1.f);
        works.push_back(c.Broadcast(got[r][root].data(), count, root));
      }
      for (auto& w : works) {
        Status s = w->Wait();
        if (!s.ok()) status[r] = s;
      }
      Status s = c.Barrier();
      if (!s.ok()) status[r] = s;
    });
    for (int r = 0; r < n; ++r) {
      REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
      for (int root = 0; root < n; ++root) CHECK(BitwiseEqual(got[r][root], RandomFloats(count, 5, root)));
    }
    CHECK(comms[0]->Broadcast(nullptr, 0, n)->Wait().code() == Code::kInvalidArgument);
  }
}

TEST_CASE("gloo send/recv: a ring, early-posted receives with several tags, same-tag order") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    Comms comms = MakeGroup(n);
    const int64_t count = 20011;
    const int kTags = 4;
    // got[r][t]: what rank r received from its left neighbour with tag t.
    std::vector<std::vector<std::vector<float>>> got(n);
    std::vector<std::vector<float>> same_tag(n);
    std::vector<Status> status(n);
    OnRanks(comms, [&](Communicator& c, int r) {
      const int right = (r + 1) % n, left = (r + n - 1) % n;
      std::vector<std::unique_ptr<Work>> works;
      got[r].assign(kTags, std::vector<float>(count, -1.f));
      // Receives posted first, long before the sends (which come after a delay, in reverse tag order).
      for (int t = 0; t < kTags; ++t) works.push_back(c.Recv(got[r][t].data(), count, left, t));
      same_tag[r].assign(2, -1.f);
      works.push_back(c.Recv(&same_tag[r][0], 1, left, 100));
      works.push_back(c.Recv(&same_tag[r][1], 1, left, 100));
      std::this_thread::sleep_for(Millis(50));
      std::vector<std::vector<float>> out(kTags);
      for (int t = kTags - 1; t >= 0; --t) {
        out[t] = RandomFloats(count, 1000 + t, r);
        works.push_back(c.Send(out[t].data(), count, right, t));
      }
      const float first = 1.f + r, second = 2.f + r;
      works.push_back(c.Send(&first, 1, right, 100));
      works.push_back(c.Send(&second, 1, right, 100));
      for (auto& w : works) {
        Status s = w->Wait();
        if (!s.ok()) status[r] = s;
      }
    });
    for (int r = 0; r < n; ++r) {
      REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
      const int left = (r + n - 1) % n;
      for (int t = 0; t < kTags; ++t) CHECK(BitwiseEqual(got[r][t], RandomFloats(count, 1000 + t, left)));
      CHECK(same_tag[r][0] == 1.f + left);
      CHECK(same_tag[r][1] == 2.f + left);
    }
    float x = 0;
    CHECK(comms[0]->Send(&x, 1, 0, 0)->Wait().code() == Code::kInvalidArgument);  // to itself
    CHECK(comms[0]->Recv(&x, 1, n, 0)->Wait().code() == Code::kInvalidArgument);
    CHECK(comms[0]->Recv(&x, 1, 1, -1)->Wait().code() == Code::kInvalidArgument);
  }
}

TEST_CASE("gloo send/recv never block collectives: recv+allreduce against send+allreduce") {
  Comms comms = MakeGroup(2);
  const int64_t count = 100003;
  std::vector<float> sent = RandomFloats(count, 3, 0), received(count, 0.f);
  std::vector<std::vector<float>> ar(2, std::vector<float>(count, 1.f));
  std::vector<Status> status(2);
  OnRanks(comms, [&](Communicator& c, int r) {
    if (r == 0) {
      auto recv = c.Recv(received.data(), count, 1, 9);
      auto all = c.AllReduce(ar[0].data(), count, ReduceOp::kSum);
      status[0] = all->Wait();  // waits on the collective before the receive
      if (status[0].ok()) status[0] = recv->Wait();
    } else {
      std::this_thread::sleep_for(Millis(30));
      auto all = c.AllReduce(ar[1].data(), count, ReduceOp::kSum);  // the collective first here
      auto send = c.Send(sent.data(), count, 0, 9);
      status[1] = all->Wait();
      if (status[1].ok()) status[1] = send->Wait();
    }
  });
  for (int r = 0; r < 2; ++r) REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
  CHECK(BitwiseEqual(received, sent));
  CHECK(ar[0] == std::vector<float>(count, 2.f));
  CHECK(ar[1] == std::vector<float>(count, 2.f));
}

TEST_CASE("gloo collectives overlap the caller: issuing returns long before a delayed peer completes") {
  Comms comms = MakeGroup(2);
  const int64_t count = 1 << 20;
  const double kDelay = 0.4;
  std::vector<std::vector<float>> data(2, std::vector<float>(count, 0.5f));
  double issue_s = 0, compute_s = 0, total_s = 0;
  double busy = 0;
  std::vector<Status> status(2);
  OnRanks(comms, [&](Communicator& c, int r) {
    if (r == 1) {
      std::this_thread::sleep_for(std::chrono::duration<double>(kDelay));
      status[1] = c.AllReduce(data[1].data(), count, ReduceOp::kSum)->Wait();
      return;
    }
    const auto t0 = Clock::now();
    auto work = c.AllReduce(data[0].data(), count, ReduceOp::kSum);
    issue_s = Since(t0);
    // Compute on this thread while the communicator thread waits for the peer.
    const auto t1 = Clock::now();
    for (int i = 0; i < 2'000'000; ++i) busy += std::sqrt(static_cast<double>(i));
    compute_s = Since(t1);
    status[0] = work->Wait();
    total_s = Since(t0);
  });
  for (int r = 0; r < 2; ++r) REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
  CHECK(busy > 0);
  CHECK(data[0] == std::vector<float>(count, 1.f));
  INFO("issue ", issue_s, " s, compute ", compute_s, " s, total ", total_s, " s");
  CHECK(total_s >= kDelay * 0.9);
  CHECK(issue_s < 0.05);
  CHECK(issue_s * 10 < total_s);
}

TEST_CASE("gloo: a peer that never arrives times out with a clear status; later calls are Aborted") {
  const Millis timeout(1000);
  Comms comms = MakeGroup(3, timeout);
  std::vector<Status> status(3);
  std::vector<double> elapsed(3);
  std::vector<float> data(3 * 1001, 1.f);
  OnRanks(comms, [&](Communicator& c, int r) {
    if (r == 2) return;  // alive, but never issues the collective
    const auto t0 = Clock::now();
    status[r] = c.AllReduce(data.data() + r * 1001, 1001, ReduceOp::kSum)->Wait();
    elapsed[r] = Since(t0);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    INFO(status[r].ToString());
    CHECK((status[r].code() == Code::kTimeout || status[r].code() == Code::kUnavailable));
    CHECK(elapsed[r] < 1.0 + 3.0);  // timeout + slack
    CHECK(status[r].message().find(fmt::format("test[{}]", r)) != std::string::npos);
    CHECK(status[r].message().find("all-reduce #0 (1001 floats, sum)") != std::string::npos);
  }
  // The first to reach its deadline reports Timeout; it closes its connections, so the other
  // may see that first (Unavailable). Neither gave up before the timeout.
  CHECK((status[0].code() == Code::kTimeout || status[1].code() == Code::kTimeout));
  CHECK(elapsed[0] >= 0.9);
  CHECK(elapsed[1] >= 0.9);
  // The failure is sticky: every later call fails at once with Aborted.
  const auto t0 = Clock::now();
  Status later = comms[0]->AllReduce(data.data(), 7, ReduceOp::kSum)->Wait();
  CHECK(later.code() == Code::kAborted);
  CHECK(later.message().find("failed earlier") != std::string::npos);
  CHECK(comms[0]->Recv(data.data(), 7, 1, 0)->Wait().code() == Code::kAborted);
  CHECK(comms[0]->Barrier().code() == Code::kAborted);
  CHECK(Since(t0) < 0.5);
}

TEST_CASE("gloo: a peer whose context is destroyed mid-run fails every other rank fast (Unavailable)") {
  // 4 ranks, rank 3 goes away. Ranks 2 and 0 are its ring neighbours and see the closed
  // socket; rank 1 is not, and learns of it because they close their connections on failure.
  const Millis timeout(20'000);
  gloo::rendezvous::HashStore store;
  auto contexts = ConnectRanks(store, 4, timeout);
  Comms comms;
  for (int r = 0; r < 3; ++r) comms.push_back(MakeGlooCommunicator(contexts[r], GlooOptions{timeout, "pp"}));
  std::vector<std::vector<float>> data(3, std::vector<float>(100003, 1.f));
  std::vector<std::unique_ptr<Work>> works;
  for (int r = 0; r < 3; ++r) works.push_back(comms[r]->AllReduce(data[r].data(), 100003, ReduceOp::kSum));
  std::this_thread::sleep_for(Millis(100));
  const auto t0 = Clock::now();
  contexts[3].reset();  // rank 3 goes away: its sockets close
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    Status s = works[r]->Wait();
    INFO(s.ToString());
    CHECK(s.code() == Code::kUnavailable);
    CHECK(s.message().find(fmt::format("pp (rank {} of 4)", r)) != std::string::npos);
  }
  CHECK(Since(t0) < 5.0);  // long before the 20 s timeout
}

TEST_CASE("gloo: a peer process killed with SIGKILL mid-collective fails the others fast") {
  char tmpl[] = "/tmp/ms_comm_test_XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string dir = tmpl;
  const Millis timeout(30'000);
  const int64_t count = 100003;
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // Rank 2 in its own process: connect, take part in one all-reduce, then hang until killed.
    int rc = 1;
    {
      gloo::rendezvous::FileStore store(dir);
      auto device = MakeGlooTcpDevice("127.0.0.1");
      if (device.ok()) {
        auto context = ConnectGlooContext(store, 2, 3, *device, Millis(10'000), "test");
        if (context.ok()) {
          auto comm = MakeGlooCommunicator(*context, GlooOptions{timeout, "child"});
          std::vector<float> data(count, 1.f);
          if (comm->AllReduce(data.data(), count, ReduceOp::kSum)->Wait().ok()) {
            std::this_thread::sleep_for(std::chrono::seconds(60));
            rc = 0;
          }
        }
      }
    }
    _exit(rc);
  }
  std::vector<std::shared_ptr<gloo::Context>> contexts;
  {
    std::vector<std::shared_ptr<gloo::Context>> got(2);
    std::vector<Status> status(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        gloo::rendezvous::FileStore store(dir);  // one per thread: a FileStore is not thread-safe
        auto device = MakeGlooTcpDevice("127.0.0.1");
        auto context = device.ok() ? ConnectGlooContext(store, r, 3, *device, Millis(10'000), "test")
                                   : Result<std::shared_ptr<gloo::Context>>(device.status());
        if (context.ok()) {
          got[r] = *context;
        } else {
          status[r] = context.status();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < 2; ++r) {
      if (!status[r].ok()) kill(child, SIGKILL), waitpid(child, nullptr, 0);
      REQUIRE_MESSAGE(status[r].ok(), status[r].ToString());
    }
    contexts = got;
  }
  Comms comms;
  for (int r = 0; r < 2; ++r) {
    comms.push_back(MakeGlooCommunicator(contexts[r], GlooOptions{timeout, fmt::format("dp[{}]", r)}));
  }
  std::vector<std::vector<float>> data(2, std::vector<float>(count, 1.f));
  std::vector<std::unique_ptr<Work>> first, second;
  for (int r = 0; r < 2; ++r) first.push_back(comms[r]->AllReduce(data[r].data(), count, ReduceOp::kSum));
  for (int r = 0; r < 2; ++r) second.push_back(comms[r]->AllReduce(data[r].data(), count, ReduceOp::kSum));
  for (int r = 0; r < 2; ++r) {
    Status s = first[r]->Wait();
    REQUIRE_MESSAGE(s.ok(), s.ToString());
    CHECK(data[r][count - 1] == 3.f);
  }
  std::this_thread::sleep_for(Millis(200));  // ranks 0 and 1 are now inside the second all-reduce
  const auto t0 = Clock::now();
  REQUIRE(kill(child, SIGKILL) == 0);
  int wstatus = 0;
  REQUIRE(waitpid(child, &wstatus, 0) == child);
  CHECK(WIFSIGNALED(wstatus));
  for (int r = 0; r < 2; ++r) {
    Status s = second[r]->Wait();
    INFO(s.ToString());
    CHECK((s.code() == Code::kUnavailable || s.code() == Code::kTimeout));
    CHECK(s.message().find(fmt::format("dp[{}]", r)) != std::string::npos);
    CHECK(s.message().find("all-reduce #1") != std::string::npos);
  }
  CHECK(Since(t0) < timeout.count() / 1000.0 + 2.0);
  CHECK(Since(t0) < 5.0);  // a dead process closes its sockets: no need to wait for the timeout
  std::filesystem::remove_all(dir);
}

TEST_CASE("gloo: destruction fails queued work with Aborted and aborts pending receives") {
  Comms comms = MakeGroup(2, Millis(5000));
  std::vector<float> a(1001, 1.f), b(1001, 1.f), c(1001, 1.f), r1(1001, 1.f), x(5, 0.f);
  auto w0 = comms[0]->AllReduce(a.data(), 1001, ReduceOp::kSum);
  auto w1 = comms[0]->AllReduce(b.data(), 1001, ReduceOp::kSum);
  auto w2 = comms[0]->Broadcast(c.data(), 1001, 0);
  auto recv = comms[0]->Recv(x.data(), 5, 1, 7);  // never sent
  Status late_status;
  std::thread late([&] {
    std::this_thread::sleep_for(Millis(300));
    late_status = comms[1]->AllReduce(r1.data(), 1001, ReduceOp::kSum)->Wait();
  });
  std::this_thread::sleep_for(Millis(100));  // the communicator thread has taken the first all-reduce
  const auto t0 = Clock::now();
  comms[0].reset();  // waits for the running all-reduce (rank 1 joins it at 300 ms), drops the rest
  const double destroy_s = Since(t0);
  late.join();
  CHECK_MESSAGE(late_status.ok(), late_status.ToString());
  CHECK(w0->Wait().ok());
  CHECK(a[0] == 2.f);
  for (Work* w : {w1.get(), w2.get()}) {
    Status s = w->Wait();
    CHECK(s.code() == Code::kAborted);
    CHECK(s.message().find("destroyed") != std::string::npos);
  }
  const auto t1 = Clock::now();
  Status rs = recv->Wait();
  CHECK(rs.code() == Code::kAborted);
  CHECK(Since(t1) < 1.0);
  CHECK(destroy_s < 5.0);
  CHECK(b[0] == 1.f);  // never touched
}

TEST_CASE("ConnectGlooContext reports a missing peer as an error, not an exception") {
  gloo::rendezvous::HashStore store;
  auto device = MakeGlooTcpDevice("127.0.0.1");
  REQUIRE(device.ok());
  const auto t0 = Clock::now();
  auto context = ConnectGlooContext(store, 0, 2, *device, Millis(500), "tp[0]");
  REQUIRE_FALSE(context.ok());
  INFO(context.status().ToString());
  CHECK((context.status().code() == Code::kTimeout || context.status().code() == Code::kUnavailable));
  CHECK(context.status().message().find("tp[0]") != std::string::npos);
  CHECK(Since(t0) < 10.0);
  CHECK_FALSE(ConnectGlooContext(store, 2, 2, *device, Millis(500), "tp[0]").ok());
}

// The threads of this process whose scheduling policy is SCHED_BATCH.
int BatchThreads() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const int policy = sched_getscheduler(static_cast<pid_t>(std::atoi(e.path().filename().c_str())));
    if (policy == SCHED_BATCH) ++n;
  }
  return n;
}

TEST_CASE("the TCP device's event-loop thread is SCHED_BATCH, unless MEGASCALE_GLOO_LOOP=normal") {
  const int before = BatchThreads();
  std::string note;
  auto device = MakeGlooTcpDevice("127.0.0.1", &note);
  REQUIRE(device.ok());
  CHECK(note == "SCHED_BATCH (no wakeup preemption)");
  CHECK(BatchThreads() == before + 1);  // the one thread the device started, and no other
  ::setenv("MEGASCALE_GLOO_LOOP", "normal", 1);
  std::string normal_note;
  auto normal = MakeGlooTcpDevice("127.0.0.1", &normal_note);
  ::unsetenv("MEGASCALE_GLOO_LOOP");
  REQUIRE(normal.ok());
  CHECK(normal_note == "left as it was (MEGASCALE_GLOO_LOOP=normal)");
  CHECK(BatchThreads() == before + 1);
  // Both still carry traffic: a 2-rank all-reduce over one device of each kind.
  gloo::rendezvous::HashStore store;
  std::shared_ptr<gloo::Context> c1;
  Status s1;
  std::thread peer([&] {
    auto c = ConnectGlooContext(store, 1, 2, *normal, Millis(20'000), "t");
    if (c.ok()) c1 = *c;
    s1 = c.status();
  });
  auto c0 = ConnectGlooContext(store, 0, 2, *device, Millis(20'000), "t");
  peer.join();
  REQUIRE(c0.ok());
  REQUIRE_MESSAGE(s1.ok(), s1.ToString());
  Comms comms;
  comms.push_back(MakeGlooCommunicator(*c0, GlooOptions{}));
  comms.push_back(MakeGlooCommunicator(c1, GlooOptions{}));
  std::vector<float> a{1, 2}, b{10, 20};
  auto w0 = comms[0]->AllReduce(a.data(), 2, ReduceOp::kSum);
  auto w1 = comms[1]->AllReduce(b.data(), 2, ReduceOp::kSum);
  REQUIRE(w0->Wait().ok());
  REQUIRE(w1->Wait().ok());
  CHECK(a == std::vector<float>{11, 22});
  CHECK(b == std::vector<float>{11, 22});
}

}  // namespace
}  // namespace ms::comm
