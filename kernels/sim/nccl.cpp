// kernels/sim/nccl.cpp: NCCL's API (the subset lib/cuda uses) on the emulated device, with NCCL's semantics, so
// that the communicator code written for GPUs runs, and can deadlock, in megascale-emu. Declarations come from
// the real nccl.h.
//
// Semantics emulated (the NCCL documentation's, not one NCCL version's buffering):
//   * Every operation is enqueued on the stream passed to it (a stream operation of the emulated runtime) and
//     runs in that stream's order; the call returns at once. The streams are switched to async mode at the first
//     ncclCommInitRank (a receive must block its stream, not the host), and marked eager (they progress by
//     themselves in the deferred mode).
//   * A receive blocks its stream until the matching send's data has arrived. A send blocks its stream until the
//     matching receive has started on the peer ("clear to send"), unless the message fits the eager limit:
//     MS_SIM_NCCL_EAGER_BYTES, default 0 — NCCL guarantees no buffering, so by default none is assumed; real
//     NCCL buffers some small messages, so a schedule that works here works there, not the other way round.
//   * Sends and receives between a pair match in issue order (NCCL has no tags).
//   * Operations issued between ncclGroupStart and ncclGroupEnd form one stream operation per stream in which
//     all of them progress together: what lets a send and a receive that depend on each other complete.
//   * Collectives block their stream until every rank has contributed; results are reduced in rank order, so
//     they are bitwise identical on every rank. Types: float, double, int64; ops: sum, max, min.
//   * In a CUDA graph (the NCCL stream forked into a stream capture): each operation is captured with the sequence
//     number it was issued with and runs again at every launch; messages of one number queue in arrival order, so
//     the k-th launches match on every rank — as NCCL requires, every rank launches its graphs in the same order.
//   * A peer that closes its connection (it died, or aborted) is ncclRemoteError from ncclCommGetAsyncError; the
//     blocked operation then completes without data. ncclCommAbort unblocks everything of the communicator.
// Fault injection for tests: MS_SIM_NCCL_STALL=<rank>:<n> makes the n-th operation (1-based, all communicators
// of the process whose MEGASCALE_RANK is <rank>) block its stream until the communicator is aborted: a stuck peer.
// MS_SIM_NCCL_DELAY_MS=<ms> holds every operation on its stream that long before it runs (a slow network): a
// consumer that does not wait for an operation then reads what was there before it, every time, not only when the
// peer happens to be late (the planted missing-wait tests).
// Transport: one Unix stream socket per pair of ranks in the abstract namespace (nothing on disk), named after
// the unique id; one receiver thread per communicator files incoming messages into inboxes.
#include <fcntl.h>
#include <nccl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "sim/blas_core.h"
#include "sim/runtime_hooks.h"

namespace ms::sim::nccl {
namespace {

constexpr char kIdMagic[] = "ms-sim-nccl:";

enum Kind : uint32_t { kData = 1, kClear = 2, kColl = 3 };

struct Header {
  uint32_t kind;
  uint32_t pad;
  uint64_t seq;
  uint64_t bytes;
};

size_t TypeBytes(ncclDataType_t t) {
  switch (t) {
    case ncclFloat32:
      return 4;
    case ncclBfloat16:
    case ncclFloat16:
      return 2;
    case ncclFloat64:
    case ncclInt64:
      return 8;
    default:
      return 0;
  }
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    c += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

std::atomic<long> g_ops{0};  // operations issued by this process (MS_SIM_NCCL_STALL)

long StallAt() {
  const char* v = std::getenv("MS_SIM_NCCL_STALL");
  const char* me = std::getenv("MEGASCALE_RANK");
  if (!v || !me) return 0;
  long rank = 0, n = 0;
  if (std::sscanf(v, "%ld:%ld", &rank, &n) != 2 || rank != std::strtol(me, nullptr, 10)) return 0;
  return n;
}

std::chrono::milliseconds DelayMs() {  // MS_SIM_NCCL_DELAY_MS (0: none)
  const char* v = std::getenv("MS_SIM_NCCL_DELAY_MS");
  const long ms = v ? std::strtol(v, nullptr, 10) : 0;
  return std::chrono::milliseconds(ms > 0 ? ms : 0);
}

}  // namespace

struct Comm {
  int rank = 0, size = 0;
  std::vector<int> fds;  // per peer (-1 for self)
  std::vector<std::unique_ptr<std::mutex>> write_mu;
  std::mutex mu;
  std::condition_variable cv;
  // (peer, kind, seq) -> payloads in arrival order: an operation captured in a CUDA graph keeps the sequence number
  // it was issued with, so each launch of the graph sends it again; the k-th launch's message is the k-th to arrive.
  std::map<std::tuple<int, uint32_t, uint64_t>, std::deque<std::vector<char>>> inbox;
  ncclResult_t async_error = ncclSuccess;
  std::string error_text;
  bool aborted = false;
  std::thread receiver;
  int wake[2] = {-1, -1};  // pipe: stops the receiver
  // Issue-order counters (taken when an operation is issued, as NCCL matches in issue order).
  std::vector<uint64_t> sent, received;
  uint64_t collectives = 0;
  size_t eager_bytes = 0;

  void Fail(ncclResult_t r, const std::string& what) {
    std::lock_guard<std::mutex> l(mu);
    if (async_error == ncclSuccess) {
      async_error = r;
      error_text = what;
    }
    cv.notify_all();
  }
  bool Send(int peer, Kind kind, uint64_t seq, const void* data, size_t bytes) {
    Header h{kind, 0, seq, bytes};
    std::lock_guard<std::mutex> l(*write_mu[static_cast<size_t>(peer)]);  // Close takes it too
    const int fd = fds[static_cast<size_t>(peer)];
    if (fd < 0 || !WriteAll(fd, &h, sizeof h) || (bytes && !WriteAll(fd, data, bytes))) {
      Fail(ncclRemoteError, "sending to peer " + std::to_string(peer) + " failed: connection closed");
      return false;
    }
    return true;
  }
  void Receive() {
    std::vector<pollfd> pfds;
    for (int p = 0; p < size; ++p) {
      if (fds[static_cast<size_t>(p)] >= 0) pfds.push_back({fds[static_cast<size_t>(p)], POLLIN, 0});
    }
    pfds.push_back({wake[0], POLLIN, 0});
    for (;;) {
      if (::poll(pfds.data(), pfds.size(), -1) < 0) {
        if (errno == EINTR) continue;
        Fail(ncclSystemError, std::string("poll: ") + std::strerror(errno));
        return;
      }
      if (pfds.back().revents) return;
      for (size_t i = 0; i + 1 < pfds.size(); ++i) {
        if (!pfds[i].revents) continue;
        const int peer = static_cast<int>(std::find(fds.begin(), fds.end(), pfds[i].fd) - fds.begin());
        Header h{};
        std::vector<char> payload;
        bool ok = ReadAll(pfds[i].fd, &h, sizeof h);
        if (ok) {
          payload.resize(h.bytes);
          ok = h.bytes == 0 || ReadAll(pfds[i].fd, payload.data(), h.bytes);
        }
        if (!ok) {
          Fail(ncclRemoteError, "peer " + std::to_string(peer) + " closed its connection (it exited or aborted)");
          pfds[i].fd = -1;  // poll ignores it from now on
          continue;
        }
        std::lock_guard<std::mutex> l(mu);
        inbox[{peer, h.kind, h.seq}].push_back(std::move(payload));
        cv.notify_all();
      }
    }
  }
  // Waits for a message; false if the communicator failed or was aborted first.
  bool Take(int peer, Kind kind, uint64_t seq, std::vector<char>* out) {
    std::unique_lock<std::mutex> l(mu);
    const auto key = std::make_tuple(peer, static_cast<uint32_t>(kind), seq);
    cv.wait(l, [&] { return aborted || async_error != ncclSuccess || inbox.count(key); });
    auto it = inbox.find(key);
    if (it == inbox.end()) return false;
    if (out) *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) inbox.erase(it);
    return true;
  }
  bool Has(int peer, Kind kind, uint64_t seq) { return inbox.count({peer, static_cast<uint32_t>(kind), seq}) != 0; }
  void Stall() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return aborted; });
  }
  void Close() {
    if (wake[1] >= 0) {
      const char c = 0;
      (void)!::write(wake[1], &c, 1);
    }
    if (receiver.joinable()) receiver.join();
    // Under the writer's lock: a late operation never writes to a closed (or reused) descriptor.
    for (size_t p = 0; p < fds.size(); ++p) {
      std::lock_guard<std::mutex> l(*write_mu[p]);
      if (fds[p] >= 0) ::close(fds[p]);
      fds[p] = -1;
    }
    for (int& fd : wake) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
};

namespace {

struct P2p {
  bool send;
  int peer;
  uint64_t seq;
  void* buf;
  size_t bytes;
};

// One stream operation: point-to-point transfers that progress together (a group, or a single one).
ncclResult_t RunP2p(const std::shared_ptr<Comm>& c, const std::vector<P2p>& ops) {
  std::vector<bool> done(ops.size(), false);
  for (size_t i = 0; i < ops.size(); ++i) {  // announce every receive; send what may go eagerly
    const P2p& o = ops[i];
    if (!o.send) {
      if (!c->Send(o.peer, kClear, o.seq, nullptr, 0)) return ncclRemoteError;
    } else if (o.bytes <= c->eager_bytes) {
      if (!c->Send(o.peer, kData, o.seq, o.buf, o.bytes)) return ncclRemoteError;
      done[i] = true;
    }
  }
  for (;;) {
    std::vector<size_t> ready;
    {
      std::unique_lock<std::mutex> l(c->mu);
      auto any = [&] {
        if (c->aborted || c->async_error != ncclSuccess) return true;
        for (size_t i = 0; i < ops.size(); ++i) {
          if (!done[i] && c->Has(ops[i].peer, ops[i].send ? kClear : kData, ops[i].seq)) return true;
        }
        return std::all_of(done.begin(), done.end(), [](bool d) { return d; });
      };
      c->cv.wait(l, any);
      if (std::all_of(done.begin(), done.end(), [](bool d) { return d; })) return ncclSuccess;
      if (c->aborted || c->async_error != ncclSuccess) return ncclRemoteError;
      for (size_t i = 0; i < ops.size(); ++i) {
        if (!done[i] && c->Has(ops[i].peer, ops[i].send ? kClear : kData, ops[i].seq)) ready.push_back(i);
      }
    }
    for (size_t i : ready) {
      const P2p& o = ops[i];
      std::vector<char> msg;
      if (!c->Take(o.peer, o.send ? kClear : kData, o.seq, &msg)) return ncclRemoteError;
      if (o.send) {
        if (!c->Send(o.peer, kData, o.seq, o.buf, o.bytes)) return ncclRemoteError;
      } else {
        if (msg.size() != o.bytes) {
          c->Fail(ncclInvalidUsage, "receive from peer " + std::to_string(o.peer) + " of " + std::to_string(o.bytes) +
                                        " bytes matched a send of " + std::to_string(msg.size()) + " bytes");
          return ncclInvalidUsage;
        }
        if (o.bytes) std::memcpy(o.buf, msg.data(), o.bytes);
      }
      done[i] = true;
    }
  }
}

template <typename T>
void Reduce(T* acc, const T* x, size_t n, ncclRedOp_t op) {
  for (size_t i = 0; i < n; ++i) {
    if (op == ncclSum) acc[i] += x[i];
    if (op == ncclMax) acc[i] = std::max(acc[i], x[i]);
    if (op == ncclMin) acc[i] = std::min(acc[i], x[i]);
  }
}

// bf16 sums (the only 16-bit reduction AddColl takes): each addition the correctly rounded bf16 sum of its operands,
// as NCCL's bf16 addition; the ranks' contributions are added in rank order.
void ReduceBf16(uint16_t* acc, const uint16_t* x, size_t n) {
  for (size_t i = 0; i < n; ++i) acc[i] = blas::FloatToBf16(blas::Bf16ToFloat(acc[i]) + blas::Bf16ToFloat(x[i]));
}

void ReduceTyped(ncclDataType_t t, void* acc, const void* x, size_t n, ncclRedOp_t op) {
  if (t == ncclBfloat16) ReduceBf16(static_cast<uint16_t*>(acc), static_cast<const uint16_t*>(x), n);
  if (t == ncclFloat32) Reduce(static_cast<float*>(acc), static_cast<const float*>(x), n, op);
  if (t == ncclFloat64) Reduce(static_cast<double*>(acc), static_cast<const double*>(x), n, op);
  if (t == ncclInt64) Reduce(static_cast<int64_t*>(acc), static_cast<const int64_t*>(x), n, op);
}

enum class Coll { kAllReduce, kReduceScatter, kAllGather, kBroadcast };

struct CollOp {
  Coll kind;
  const void* in;
  void* out;
  size_t count;  // elements of the result per rank (reduce-scatter: of the output; all-gather: of the input)
  ncclDataType_t type;
  ncclRedOp_t op;
  int root;
  uint64_t seq;
};

ncclResult_t RunColl(const std::shared_ptr<Comm>& c, const CollOp& o) {
  const size_t eb = TypeBytes(o.type);
  const size_t in_bytes = (o.kind == Coll::kReduceScatter ? o.count * static_cast<size_t>(c->size) : o.count) * eb;
  std::vector<char> mine(static_cast<const char*>(o.in), static_cast<const char*>(o.in) + in_bytes);
  const bool sends = o.kind != Coll::kBroadcast || c->rank == o.root;
  for (int p = 0; p < c->size && sends; ++p) {
    if (p != c->rank && !c->Send(p, kColl, o.seq, mine.data(), mine.size())) return ncclRemoteError;
  }
  std::vector<std::vector<char>> all(static_cast<size_t>(c->size));
  for (int p = 0; p < c->size; ++p) {
    if (p == c->rank) {
      all[static_cast<size_t>(p)] = mine;
    } else if (o.kind != Coll::kBroadcast || p == o.root) {
      if (!c->Take(p, kColl, o.seq, &all[static_cast<size_t>(p)])) return ncclRemoteError;
      if (all[static_cast<size_t>(p)].size() != in_bytes) {
        c->Fail(ncclInvalidUsage, "collective #" + std::to_string(o.seq) + ": peer " + std::to_string(p) +
                                      " contributed " + std::to_string(all[static_cast<size_t>(p)].size()) +
                                      " bytes, this rank " + std::to_string(in_bytes));
        return ncclInvalidUsage;
      }
    }
  }
  switch (o.kind) {
    case Coll::kAllReduce: {
      std::vector<char> acc = all[0];
      for (int p = 1; p < c->size; ++p)
        ReduceTyped(o.type, acc.data(), all[static_cast<size_t>(p)].data(), o.count, o.op);
      std::memcpy(o.out, acc.data(), acc.size());
      break;
    }
    case Coll::kReduceScatter: {
      const size_t off = static_cast<size_t>(c->rank) * o.count * eb;
      std::vector<char> acc(all[0].begin() + static_cast<ptrdiff_t>(off),
                            all[0].begin() + static_cast<ptrdiff_t>(off + o.count * eb));
      for (int p = 1; p < c->size; ++p) {
        ReduceTyped(o.type, acc.data(), all[static_cast<size_t>(p)].data() + off, o.count, o.op);
      }
      std::memcpy(o.out, acc.data(), acc.size());
      break;
    }
    case Coll::kAllGather:
      for (int p = 0; p < c->size; ++p) {
        std::memcpy(static_cast<char*>(o.out) + static_cast<size_t>(p) * in_bytes, all[static_cast<size_t>(p)].data(),
                    in_bytes);
      }
      break;
    case Coll::kBroadcast:
      std::memcpy(o.out, all[static_cast<size_t>(o.root)].data(), in_bytes);
      break;
  }
  return ncclSuccess;
}

// ---- groups ----

struct Pending {
  std::shared_ptr<Comm> comm;
  cudaStream_t stream;
  std::vector<P2p> p2p;
  std::vector<CollOp> colls;
};
thread_local int tls_group_depth = 0;
thread_local std::vector<Pending> tls_group;

std::mutex g_handles_mu;
std::map<ncclComm_t, std::shared_ptr<Comm>> g_handles;

std::shared_ptr<Comm> Get(ncclComm_t h) {
  std::lock_guard<std::mutex> l(g_handles_mu);
  auto it = g_handles.find(h);
  return it == g_handles.end() ? nullptr : it->second;
}

ncclResult_t Launch(Pending p) {
  const long stall = StallAt();
  static const std::chrono::milliseconds delay = DelayMs();
  const long n = ++g_ops;
  const cudaError_t e = EnqueueOnStream(p.stream, "nccl", [p = std::move(p), stall, n]() {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    if (stall > 0 && n >= stall) p.comm->Stall();
    ncclResult_t r = ncclSuccess;
    for (const CollOp& o : p.colls) {
      if (r == ncclSuccess) r = RunColl(p.comm, o);
    }
    if (r == ncclSuccess && !p.p2p.empty()) r = RunP2p(p.comm, p.p2p);
    // A failed operation leaves the stream running (as an aborted NCCL kernel does); the error is the
    // communicator's (ncclCommGetAsyncError).
    if (r != ncclSuccess) p.comm->Fail(r, "an operation failed");
    return cudaSuccess;
  });
  return e == cudaSuccess ? ncclSuccess : ncclInvalidArgument;
}

ncclResult_t Add(ncclComm_t h, cudaStream_t stream, const P2p* p2p, const CollOp* coll) {
  auto c = Get(h);
  if (!c) return ncclInvalidArgument;
  if (!IsKnownStream(stream)) return ncclInvalidArgument;
  SetStreamEager(stream);
  if (tls_group_depth == 0) {
    Pending p{c, stream, {}, {}};
    if (p2p) p.p2p.push_back(*p2p);
    if (coll) p.colls.push_back(*coll);
    return Launch(std::move(p));
  }
  auto it = std::find_if(tls_group.begin(), tls_group.end(),
                         [&](const Pending& q) { return q.comm == c && q.stream == stream; });
  if (it == tls_group.end()) {
    tls_group.push_back(Pending{c, stream, {}, {}});
    it = tls_group.end() - 1;
  }
  if (p2p) it->p2p.push_back(*p2p);
  if (coll) it->colls.push_back(*coll);
  return ncclSuccess;
}

ncclResult_t AddColl(Coll kind, const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op, int root,
                     ncclComm_t h, cudaStream_t stream) {
  auto c = Get(h);
  if (!c) return ncclInvalidArgument;
  if (TypeBytes(type) == 0 || (op != ncclSum && op != ncclMax && op != ncclMin)) return ncclInvalidArgument;
  // 16-bit types are moved (all-gather, broadcast); of their reductions only the bf16 sum is emulated: refuse the
  // others rather than reduce them wrongly.
  if (TypeBytes(type) == 2 && (kind == Coll::kAllReduce || kind == Coll::kReduceScatter) &&
      (type != ncclBfloat16 || op != ncclSum)) {
    return ncclInvalidArgument;
  }
  if (root < 0 || root >= c->size) return ncclInvalidArgument;
  CollOp o{kind, in, out, count, type, op, root, 0};
  {
    std::lock_guard<std::mutex> l(c->mu);
    o.seq = ++c->collectives;
  }
  return Add(h, stream, nullptr, &o);
}

ncclResult_t AddP2p(bool send, void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t h,
                    cudaStream_t stream) {
  auto c = Get(h);
  if (!c || TypeBytes(type) == 0 || peer < 0 || peer >= c->size || peer == c->rank) return ncclInvalidArgument;
  P2p o{send, peer, 0, buf, count * TypeBytes(type)};
  {
    std::lock_guard<std::mutex> l(c->mu);
    o.seq = send ? ++c->sent[static_cast<size_t>(peer)] : ++c->received[static_cast<size_t>(peer)];
  }
  return Add(h, stream, &o, nullptr);
}

std::string SocketName(const std::string& id, int rank) {
  return id + "-" + std::to_string(rank);
}

// An abstract-namespace address (leading NUL: nothing on disk) and its length.
socklen_t AbstractAddress(const std::string& name, sockaddr_un* a) {
  *a = sockaddr_un{};
  a->sun_family = AF_UNIX;
  const size_t n = std::min(name.size(), sizeof(a->sun_path) - 2);
  std::memcpy(a->sun_path + 1, name.data(), n);
  return static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + n);
}

int Listen(const std::string& name) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un a;
  const socklen_t len = AbstractAddress(name, &a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), len) != 0 || ::listen(fd, 256) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

int Connect(const std::string& name, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    sockaddr_un a;
    const socklen_t len = AbstractAddress(name, &a);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), len) == 0) return fd;
    ::close(fd);
    if (std::chrono::steady_clock::now() > deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

}  // namespace
}  // namespace ms::sim::nccl

using ms::sim::nccl::Comm;

struct ncclComm {};  // handles are addresses of these; the state lives in g_handles

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      return "unhandled cuda error";
    case ncclSystemError:
      return "unhandled system error (emulated NCCL)";
    case ncclInternalError:
      return "internal error (emulated NCCL)";
    case ncclInvalidArgument:
      return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage:
      return "invalid usage (emulated NCCL)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (emulated NCCL)";
    case ncclInProgress:
      return "NCCL operation in progress";
    default:
      return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  thread_local std::string text;
  auto c = ms::sim::nccl::Get(comm);
  if (!c) return "";
  std::lock_guard<std::mutex> l(c->mu);
  text = c->error_text;
  return text.c_str();
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  if (!id) return ncclInvalidArgument;
  std::random_device rd;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s%08x%08x%d", ms::sim::nccl::kIdMagic, rd(), rd(), static_cast<int>(getpid()));
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, buf, std::strlen(buf));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  using namespace ms::sim::nccl;
  if (!out || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
  if (key.rfind(kIdMagic, 0) != 0) return ncclInvalidArgument;
  // A receive must block its stream, not the calling thread: the emulated streams run asynchronously from now on.
  if (ms::sim::GetStreamMode() == ms::sim::StreamMode::kSync) ms::sim::SetStreamMode(ms::sim::StreamMode::kAsync);
  auto c = std::make_shared<Comm>();
  c->rank = rank;
  c->size = nranks;
  c->fds.assign(static_cast<size_t>(nranks), -1);
  for (int i = 0; i < nranks; ++i) c->write_mu.push_back(std::make_unique<std::mutex>());
  c->sent.assign(static_cast<size_t>(nranks), 0);
  c->received.assign(static_cast<size_t>(nranks), 0);
  if (const char* e = std::getenv("MS_SIM_NCCL_EAGER_BYTES")) c->eager_bytes = std::strtoull(e, nullptr, 10);
  const auto timeout = std::chrono::seconds(120);
  int listener = -1;
  if (rank + 1 < nranks) {
    listener = Listen(SocketName(key, rank));
    if (listener < 0) return ncclSystemError;
  }
  for (int p = 0; p < rank; ++p) {  // connect to the lower ranks, saying who we are
    const int fd = Connect(SocketName(key, p), timeout);
    const int32_t me = rank;
    if (fd < 0 || !WriteAll(fd, &me, sizeof me)) {
      if (fd >= 0) ::close(fd);
      c->Close();
      if (listener >= 0) ::close(listener);
      return ncclSystemError;
    }
    c->fds[static_cast<size_t>(p)] = fd;
  }
  for (int k = rank + 1; k < nranks; ++k) {  // accept the higher ranks
    pollfd pf{listener, POLLIN, 0};
    const int ready = ::poll(&pf, 1, static_cast<int>(timeout.count() * 1000));
    const int fd = ready > 0 ? ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC) : -1;
    int32_t who = -1;
    if (fd < 0 || !ReadAll(fd, &who, sizeof who) || who <= rank || who >= nranks ||
        c->fds[static_cast<size_t>(who)] >= 0) {
      if (fd >= 0) ::close(fd);
      c->Close();
      ::close(listener);
      return ncclSystemError;
    }
    c->fds[static_cast<size_t>(who)] = fd;
  }
  if (listener >= 0) ::close(listener);
  if (::pipe2(c->wake, O_CLOEXEC) != 0) {
    c->Close();
    return ncclSystemError;
  }
  c->receiver = std::thread([c = c.get()] { c->Receive(); });
  auto* handle = reinterpret_cast<ncclComm_t>(new ncclComm);
  {
    std::lock_guard<std::mutex> l(g_handles_mu);
    g_handles[handle] = c;
  }
  *out = handle;
  return ncclSuccess;
}

namespace {
// ncclCommDestroy (the caller has synchronized its streams: nothing is in flight) and ncclCommAbort alike: the
// handle goes, operations still queued (they hold their own reference) return at once, the sockets close.
ncclResult_t Release(ncclComm_t comm) {
  std::shared_ptr<Comm> c;
  {
    std::lock_guard<std::mutex> l(ms::sim::nccl::g_handles_mu);
    auto it = ms::sim::nccl::g_handles.find(comm);
    if (it == ms::sim::nccl::g_handles.end()) return ncclInvalidArgument;
    c = it->second;
    ms::sim::nccl::g_handles.erase(it);
  }
  {
    std::lock_guard<std::mutex> l(c->mu);
    c->aborted = true;
    c->cv.notify_all();
  }
  c->Close();
  delete reinterpret_cast<ncclComm*>(comm);
  return ncclSuccess;
}
}  // namespace

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  return Release(comm);
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  return Release(comm);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* err) {
  auto c = ms::sim::nccl::Get(comm);
  if (!c || !err) return ncclInvalidArgument;
  std::lock_guard<std::mutex> l(c->mu);
  *err = c->async_error;
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  auto c = ms::sim::nccl::Get(comm);
  if (!c || !count) return ncclInvalidArgument;
  *count = c->size;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  auto c = ms::sim::nccl::Get(comm);
  if (!c || !rank) return ncclInvalidArgument;
  *rank = c->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return ms::sim::nccl::AddColl(ms::sim::nccl::Coll::kAllReduce, in, out, count, type, op, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* in, void* out, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  return ms::sim::nccl::AddColl(ms::sim::nccl::Coll::kReduceScatter, in, out, count, type, op, 0, comm, stream);
}

ncclResult_t ncclAllGather(const void* in, void* out, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return ms::sim::nccl::AddColl(ms::sim::nccl::Coll::kAllGather, in, out, count, type, ncclSum, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* in, void* out, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return ms::sim::nccl::AddColl(ms::sim::nccl::Coll::kBroadcast, in, out, count, type, ncclSum, root, comm, stream);
}

ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return ms::sim::nccl::AddP2p(true, const_cast<void*>(buf), count, type, peer, comm, stream);
}

ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  return ms::sim::nccl::AddP2p(false, buf, count, type, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++ms::sim::nccl::tls_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  using namespace ms::sim::nccl;
  if (tls_group_depth == 0) return ncclInvalidUsage;
  if (--tls_group_depth > 0) return ncclSuccess;
  std::vector<Pending> group = std::move(tls_group);
  tls_group.clear();
  ncclResult_t r = ncclSuccess;
  for (Pending& p : group) {
    if (ncclResult_t q = Launch(std::move(p)); r == ncclSuccess) r = q;
  }
  return r;
}
