// libfabric messages between two endpoints of one process, each driven by its own thread: sizes and
// contents both ways, unexpected messages, timeouts, unknown providers, PingPong, Stream, slowdown.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "fabric/fabric.h"

namespace ms::fabric {
namespace {

constexpr double kTimeoutS = 20;

struct Pair {
  std::unique_ptr<Endpoint> a, b;
  uint64_t a_to_b = 0;  // b's handle on a
  uint64_t b_to_a = 0;  // a's handle on b
};

Result<Pair> OpenPair(const std::string& provider) {
  Pair p;
  MS_ASSIGN_OR_RETURN(p.a, Endpoint::Open(provider));
  MS_ASSIGN_OR_RETURN(p.b, Endpoint::Open(provider));
  MS_ASSIGN_OR_RETURN(p.a_to_b, p.a->AddPeer(p.b->Name()));
  MS_ASSIGN_OR_RETURN(p.b_to_a, p.b->AddPeer(p.a->Name()));
  return p;
}

// Runs the two sides on their own threads; each returns a Status, checked on this thread.
template <typename A, typename B>
void RunBoth(A side_a, B side_b) {
  Status status_a, status_b;
  std::thread ta([&] { status_a = side_a(); });
  std::thread tb([&] { status_b = side_b(); });
  ta.join();
  tb.join();
  CHECK_MESSAGE(status_a.ok(), status_a.ToString());
  CHECK_MESSAGE(status_b.ok(), status_b.ToString());
}

std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 8));
  return v;
}

Status Expect(const std::vector<uint8_t>& got, size_t bytes, uint8_t seed) {
  if (got != Pattern(bytes, seed)) return DataLoss("{} bytes (seed {}) arrived altered", bytes, seed);
  return Status::Ok();
}

// The providers exercised: tcp always; shm when it opens and carries a message within this
// process. (shm needs a writable /dev/shm; where a sandbox lacks one, it is skipped with a message.)
std::vector<std::string> Providers() {
  std::vector<std::string> out = {"tcp"};
  auto pair = OpenPair("shm");
  if (!pair.ok()) {
    MESSAGE("shm skipped: " << pair.status().ToString());
    return out;
  }
  uint8_t byte = 42, got = 0;
  Status sent, received;
  std::thread t([&] { sent = pair->a->Send(&byte, 1, pair->b_to_a, 5); });
  received = pair->b->Recv(&got, 1, pair->a_to_b, 5);
  t.join();
  if (!sent.ok() || !received.ok() || got != byte) {
    MESSAGE("shm skipped: it opens but carries no message here: " << sent.ToString() << " / " << received.ToString());
    return out;
  }
  out.push_back("shm");
  return out;
}

const std::vector<std::string>& TestProviders() {
  static const std::vector<std::string> providers = Providers();
  return providers;
}

}  // namespace

TEST_CASE("ListProviders offers tcp; an unknown provider is NotFound naming the available ones") {
  auto list = ListProviders();
  REQUIRE_MESSAGE(list.ok(), list.status().ToString());
  CHECK(std::find(list->begin(), list->end(), "tcp") != list->end());

  auto ep = Endpoint::Open("nonexistent");
  REQUIRE(!ep.ok());
  CHECK(ep.status().code() == Code::kNotFound);
  CHECK(ep.status().message().find("nonexistent") != std::string::npos);
  CHECK(ep.status().message().find("tcp") != std::string::npos);

  CHECK(Endpoint::Open("").status().code() == Code::kInvalidArgument);
}

TEST_CASE("names, peers and arguments") {
  auto ep = Endpoint::Open("tcp");
  REQUIRE_MESSAGE(ep.ok(), ep.status().ToString());
  Endpoint& e = **ep;
  CHECK(e.provider().find("tcp") == 0);
  std::string name = e.Name();
  CHECK(!name.empty());
  CHECK(name.size() % 2 == 0);
  CHECK(name.find_first_not_of("0123456789abcdef") == std::string::npos);
  for (const char* bad : {"", "abc", "zz", "0g"}) {
    auto r = e.AddPeer(bad);
    CHECK_MESSAGE(r.status().code() == Code::kInvalidArgument, bad);
  }
  auto self = e.AddPeer(name);
  REQUIRE(self.ok());
  uint8_t byte = 0;
  CHECK(e.Send(&byte, 1, *self + 1000, 1).code() == Code::kInvalidArgument);  // never added
  CHECK(e.Send(nullptr, 1, *self, 1).code() == Code::kInvalidArgument);
  CHECK(e.Recv(&byte, 1, *self, -1).code() == Code::kInvalidArgument);
  CHECK(Stream(e, *self, true, 0, 1).status().code() == Code::kInvalidArgument);
  CHECK(PingPong(e, *self, true, 8, 0).status().code() == Code::kInvalidArgument);
  // A message to itself works too, and none of the above broke the endpoint.
  CHECK(e.Send(&byte, 1, *self, 5).ok());
  uint8_t got = 1;
  CHECK(e.Recv(&got, 1, *self, 5).ok());
  CHECK(got == 0);
}

TEST_CASE("odd sizes both ways, contents intact") {
  const std::vector<size_t> sizes = {1, 7, 4099, (1 << 20) + 3};
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    Endpoint& a = *pair->a;
    Endpoint& b = *pair->b;
    RunBoth(
        [&]() -> Status {
          for (size_t n : sizes) {
            auto out = Pattern(n, 1);
            MS_RETURN_IF_ERROR(a.Send(out.data(), n, pair->b_to_a, kTimeoutS));
            std::vector<uint8_t> in(n);
            MS_RETURN_IF_ERROR(a.Recv(in.data(), n, pair->b_to_a, kTimeoutS));
            MS_RETURN_IF_ERROR(Expect(in, n, 2));
          }
          return Status::Ok();
        },
        [&]() -> Status {
          for (size_t n : sizes) {
            std::vector<uint8_t> in(n);
            MS_RETURN_IF_ERROR(b.Recv(in.data(), n, pair->a_to_b, kTimeoutS));
            MS_RETURN_IF_ERROR(Expect(in, n, 1));
            auto out = Pattern(n, 2);
            MS_RETURN_IF_ERROR(b.Send(out.data(), n, pair->a_to_b, kTimeoutS));
          }
          return Status::Ok();
        });
  }
}

TEST_CASE("messages sent before the receive is posted arrive, in order") {
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    Endpoint& a = *pair->a;
    Endpoint& b = *pair->b;
    const std::vector<size_t> sizes = {100, 3000, 3};  // below shm's 4 KiB inject and rxm's eager limits
    const size_t large = 300 << 10;
    std::promise<void> small_sent;
    // Data progress is manual (tcp;ofi_rxm, shm): a peer's first message needs the other side in a
    // call to set up the connection, so the two say hello first.
    RunBoth(
        [&]() -> Status {
          uint8_t hello = 1;
          MS_RETURN_IF_ERROR(a.Send(&hello, 1, pair->b_to_a, kTimeoutS));
          return a.Recv(&hello, 1, pair->b_to_a, kTimeoutS);
        },
        [&]() -> Status {
          uint8_t hello = 2;
          MS_RETURN_IF_ERROR(b.Recv(&hello, 1, pair->a_to_b, kTimeoutS));
          return b.Send(&hello, 1, pair->a_to_b, kTimeoutS);
        });
    RunBoth(
        [&]() -> Status {
          // Small messages complete at the sender without the receiver's help: all three are sent
          // (completed) before b posts any receive.
          Status sent;
          for (size_t i = 0; i < sizes.size() && sent.ok(); ++i) {
            auto out = Pattern(sizes[i], static_cast<uint8_t>(10 + i));
            sent = a.Send(out.data(), sizes[i], pair->b_to_a, 5);
          }
          small_sent.set_value();
          MS_RETURN_IF_ERROR(sent);
          // A large one is still on its way when b posts its receive, well after this send started.
          auto out = Pattern(large, 20);
          return a.Send(out.data(), large, pair->b_to_a, kTimeoutS);
        },
        [&]() -> Status {
          small_sent.get_future().wait();
          std::this_thread::sleep_for(std::chrono::milliseconds(200));
          for (size_t i = 0; i < sizes.size(); ++i) {
            std::vector<uint8_t> in(sizes[i]);
            MS_RETURN_IF_ERROR(b.Recv(in.data(), sizes[i], pair->a_to_b, kTimeoutS));
            MS_RETURN_IF_ERROR(Expect(in, sizes[i], static_cast<uint8_t>(10 + i)));
          }
          std::vector<uint8_t> in(large);
          MS_RETURN_IF_ERROR(b.Recv(in.data(), large, pair->a_to_b, kTimeoutS));
          return Expect(in, large, 20);
        });
  }
}

TEST_CASE("a message of another size than the receive expects is DataLoss") {
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    Endpoint& a = *pair->a;
    Endpoint& b = *pair->b;
    const bool truncate = provider != "shm";
    Status longer, shorter, truncated, after;
    RunBoth(
        [&]() -> Status {
          auto out = Pattern(1 << 20, 5);
          MS_RETURN_IF_ERROR(a.Send(out.data(), 16, pair->b_to_a, kTimeoutS));
          MS_RETURN_IF_ERROR(a.Send(out.data(), 4, pair->b_to_a, kTimeoutS));
          MS_RETURN_IF_ERROR(a.Send(out.data(), 8, pair->b_to_a, kTimeoutS));
          // Far larger than the receive's buffer: truncated by the provider. Not on shm: libfabric
          // 1.17's shm spins forever inside fi_recv (process_vm_readv in a loop) when an unexpected
          // message above its 4 KiB inject size must be truncated.
          if (!truncate) return Status::Ok();
          return a.Send(out.data(), out.size(), pair->b_to_a, kTimeoutS);
        },
        [&]() -> Status {
          std::vector<uint8_t> in(8);
          longer = b.Recv(in.data(), 8, pair->a_to_b, kTimeoutS);   // 16 bytes came
          shorter = b.Recv(in.data(), 8, pair->a_to_b, kTimeoutS);  // 4 bytes came
          MS_RETURN_IF_ERROR(b.Recv(in.data(), 8, pair->a_to_b, kTimeoutS));
          MS_RETURN_IF_ERROR(Expect(in, 8, 5));
          if (!truncate) return Status::Ok();
          truncated = b.Recv(in.data(), 8, pair->a_to_b, kTimeoutS);
          after = b.Recv(in.data(), 8, pair->a_to_b, kTimeoutS);
          return Status::Ok();
        });
    CHECK(longer.code() == Code::kDataLoss);
    CHECK(longer.message().find("16-byte") != std::string::npos);
    CHECK(shorter.code() == Code::kDataLoss);
    CHECK(shorter.message().find("4-byte") != std::string::npos);
    // The provider's truncation comes back as a completion error naming the call, and breaks the
    // endpoint (tcp;ofi_rxm drops the connection then: what follows on it would be lost).
    if (truncate) {
      CHECK(truncated.code() == Code::kDataLoss);
      CHECK(truncated.message().find("fi_recv") != std::string::npos);
      CHECK(truncated.message().find(b.provider()) != std::string::npos);
      CHECK(after.code() == Code::kFailedPrecondition);
      MESSAGE(provider << ": " << truncated.ToString() << " / then: " << after.ToString());
    }
  }
}

TEST_CASE("a receive that times out returns Timeout and leaves the endpoint refusing calls") {
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    Endpoint& a = *pair->a;
    Endpoint& b = *pair->b;
    RunBoth([&] { return a.Send("hi", 2, pair->b_to_a, kTimeoutS); },  // connected, see above
            [&] {
              char hi[2];
              return b.Recv(hi, 2, pair->a_to_b, kTimeoutS);
            });
    std::vector<uint8_t> in(64);
    double start = NowSeconds();
    Status s = b.Recv(in.data(), in.size(), pair->a_to_b, 0.3);
    double took = NowSeconds() - start;
    CHECK(s.code() == Code::kTimeout);
    CHECK(took >= 0.29);
    CHECK(took < 1.5);
    CHECK(s.message().find(b.provider()) != std::string::npos);

    Status again = b.Recv(in.data(), in.size(), pair->a_to_b, 1);
    CHECK(again.code() == Code::kFailedPrecondition);
    CHECK(again.message().find("timed out") != std::string::npos);
    CHECK(b.Send(in.data(), 8, pair->a_to_b, 1).code() == Code::kFailedPrecondition);
    CHECK(PingPong(b, pair->a_to_b, true, 8, 1).status().code() == Code::kFailedPrecondition);
    // The message a sends now lands in b's still-posted receive (b's buffer, not the caller's);
    // destroying b afterwards is clean.
    auto out = Pattern(64, 3);
    CHECK(a.Send(out.data(), out.size(), pair->b_to_a, 5).ok());
  }
}

TEST_CASE("PingPong: a positive latency on both sides") {
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    double la = 0, lb = 0;
    RunBoth(
        [&]() -> Status {
          MS_ASSIGN_OR_RETURN(la, PingPong(*pair->a, pair->b_to_a, true, 8, 200));
          return Status::Ok();
        },
        [&]() -> Status {
          MS_ASSIGN_OR_RETURN(lb, PingPong(*pair->b, pair->a_to_b, false, 8, 200));
          return Status::Ok();
        });
    CHECK(la > 0);
    CHECK(lb > 0);
    CHECK(la < 0.1);
    CHECK(lb < 0.1);
    MESSAGE(provider << " one-way latency, 8 bytes: " << la * 1e6 << " us (initiator), " << lb * 1e6 << " us");
  }
}

namespace {

// Streams `count` messages of `bytes` from a to b; returns the sender's bandwidth (bytes/s).
double RunStream(Pair& pair, size_t bytes, int count) {
  double bw = 0, rx = -1;
  RunBoth(
      [&]() -> Status {
        MS_ASSIGN_OR_RETURN(bw, Stream(*pair.a, pair.b_to_a, true, bytes, count));
        return Status::Ok();
      },
      [&]() -> Status {
        MS_ASSIGN_OR_RETURN(rx, Stream(*pair.b, pair.a_to_b, false, bytes, count));
        return Status::Ok();
      });
  CHECK(rx == 0);
  return bw;
}

}  // namespace

TEST_CASE("Stream: a positive bandwidth on the sender, 0 on the receiver") {
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    double bw = RunStream(*pair, 64 << 10, 200);
    CHECK(bw > 0);
    bw = RunStream(*pair, 1 << 20, 30);
    CHECK(bw > 0);
    MESSAGE(provider << " stream, 1 MiB messages: " << bw / 1e9 << " GB/s");
    // Small messages too (several per window slot), and the endpoint still carries plain messages.
    CHECK(RunStream(*pair, 3, 1000) > 0);
    RunBoth([&] { return pair->a->Send("x", 1, pair->b_to_a, 5); },
            [&] {
              char c = 0;
              Status s = pair->b->Recv(&c, 1, pair->a_to_b, 5);
              return s.ok() && c != 'x' ? DataLoss("got '{}'", c) : s;
            });
  }
}

TEST_CASE("set_slowdown(3) makes Stream at least 1.8 times slower") {
  // A slowed sender streams one message at a time, each followed by twice its duration: against the
  // plain pipelined stream that is 3x or more (tcp: ~4-5x here).
  for (const std::string& provider : TestProviders()) {
    CAPTURE(provider);
    auto pair = OpenPair(provider);
    REQUIRE_MESSAGE(pair.ok(), pair.status().ToString());
    const size_t bytes = 1 << 20;  // as megascale self-check streams
    const int count = 8;
    const double total = static_cast<double>(bytes) * count;
    RunStream(*pair, bytes, count);  // connections up, buffers allocated
    // Timings on a shared machine only get longer: the best of two plain runs against a slowed
    // one, a few attempts.
    double fast = 0, slow = 0;
    for (int attempt = 0; attempt < 3 && !(slow >= 1.8 * fast && fast > 0); ++attempt) {
      fast = std::min(total / RunStream(*pair, bytes, count), total / RunStream(*pair, bytes, count));
      pair->a->set_slowdown(3);
      slow = total / RunStream(*pair, bytes, count);
      pair->a->set_slowdown(1);
      MESSAGE(provider << " stream of " << count << " x " << bytes << " bytes: " << fast * 1e3
                       << " ms, slowed x3: " << slow * 1e3 << " ms (" << slow / fast << "x)");
    }
    CHECK(slow >= 1.8 * fast);
  }
}

}  // namespace ms::fabric
