// Communicator: collectives and point-to-point transfers within one process group.
//
// Contract
// --------
// Every call is asynchronous: it returns a Work handle at once, the transfer runs on the
// communicator's own thread (Gloo, CPU backend) or stream (NCCL, CUDA backend), and the
// caller overlaps compute until it calls Wait(). Buffers must stay valid and untouched
// until then. Collectives on one communicator are executed in the order they were issued,
// and every member of the group must issue the same collectives, with the same counts, in
// the same order. Destroying a Work that was not waited for waits for it (its status is
// dropped; a failure still shows in every later call, see below), so a forgotten handle
// can never leave a transfer writing into freed memory.
//
// Thread safety: one issuing thread per communicator at a time (the issue order is what
// matches operations across ranks; calls from several threads would race for it). A Work
// may be waited on from any thread, once or many times (later calls return the same
// status). Different communicators are independent.
//
// The Gloo communicator (MakeGlooCommunicator)
// ---------------------------------------------
// * One thread per communicator. Each collective call packs its arguments into a task,
//   appends it to a FIFO queue and returns; the communicator's thread runs the tasks one
//   at a time, strictly in issue order. One thread (rather than a pool) is what makes the
//   order identical on every rank without any extra agreement protocol, and one collective
//   in flight per group keeps Gloo's message matching unambiguous. The
//   calling thread is free meanwhile: compute overlaps communication. A collective whose
//   count is 0 still takes its place in the queue and completes as a no-op.
// * Every collective carries its sequence number (the n-th collective issued on this
//   communicator) as Gloo's tag, so a stale message from an aborted operation can never
//   be matched by a later one, and every error message names it ("all-reduce #12").
// * AllReduce (float, double, int64; sum, max, min): gloo::allreduce, ring algorithm
//   (reduce-scatter, then all-gather of the reduced chunks). Each chunk is reduced on one
//   rank in a fixed ring order and then copied to the others, so the result is bitwise
//   identical on every rank and from run to run.
// * ReduceScatter: our own ring over Gloo unbound buffers (gloo's ReduceScatter* classes
//   use the old bound-buffer API without per-operation timeouts). size()-1 steps; in step
//   s rank r sends its partial sum of chunk (r-s-1) mod n to rank r+1 and receives chunk
//   (r-s-2) mod n from rank r-1, adds its own contribution, and after the last step holds
//   chunk r summed over all ranks. Traffic per rank: (n-1)/n of the input, the optimum (an
//   all-reduce into scratch would move twice that). Deterministic: every chunk is summed
//   in the same ring order on every run. Scratch: 2*count floats, kept by the
//   communicator. `out` must not overlap `in`.
// * AllGather, AllGather16: gloo::allgather (ring). Broadcast: gloo::broadcast (binomial tree).
//   Barrier: gloo::barrier, queued behind earlier collectives and waited for.
// * Send/Recv do not go through the queue: the call posts the transfer to Gloo at once
//   (context->createUnboundBuffer + send/recv on slot = (p2p prefix, tag)), Gloo's
//   transport thread moves the bytes whenever both sides have posted, and Wait() blocks
//   on completion. So point-to-point transfers never block collectives or each other:
//   rank A may post Recv(from B) and then an AllReduce while B posts Send(to A) and then
//   the AllReduce, receives may be posted long before the matching send, and any number
//   of tags may be in flight between a pair. Transfers with the same (peer, tag) match in
//   posting order. The counts of a matching send and recv must be equal (Gloo treats a
//   larger message than the posted receive as a fatal error in its transport thread).
// * Timeouts and failures: every collective runs under GlooOptions::timeout (Gloo applies
//   it to each wait inside its algorithms; the ring reduce-scatter to the whole
//   operation); a Send/Recv Wait() waits at most that long. A peer that died
//   shows as a closed connection (Unavailable, usually within milliseconds); a peer that
//   never arrives shows as Timeout. The Status names the communicator, this rank, the
//   operation with its sequence number and size, the peers involved and Gloo's message.
//   The transport is then in an unknown state, so the first failure is sticky: every later
//   call, and every queued task, fails at once with Aborted naming the original failure.
//   The failing rank also closes all its connections of this group, so that the failure
//   spreads to every peer within milliseconds (they see Unavailable: connection closed)
//   instead of each waiting for its own timeout; a rank that is not a ring neighbour of a
//   dead rank learns of it this way. Recovery is to rebuild the group (the driver restarts
//   the job).
// * Destruction: queued tasks that have not started fail with Aborted, the running one
//   finishes (bounded by the timeout), the thread is joined, and sends/receives not yet
//   waited for are aborted (their Wait() reports Aborted).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace ms::comm {

enum class ReduceOp { kSum, kMax, kMin };
std::string_view ReduceOpName(ReduceOp op);

// One send or receive of a GroupP2p.
struct P2pOp {
  bool send = false;
  float* data = nullptr;  // a send only reads it
  int64_t count = 0;
  int peer = 0;
  int tag = 0;
};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation is complete; returns its error (peer failure, timeout).
  virtual Status Wait() = 0;
  // Orders what the backend enqueues after this call behind the operation's completion, without blocking the host
  // where the communicator can (Communicator::waits_on_device: NCCL makes the backend's stream wait for the
  // operation's completion event). The operation's later failure (peer failure, timeout) is then found by the
  // communicator's watchdog, which aborts it; Drain() and every later operation of the communicator report it.
  // Returns an error known already. The default waits on the host (Wait()).
  virtual Status WaitOnDevice() { return Wait(); }
};

// A Work that is complete already: its Wait returns `s` (an operation with nothing to move, or one refused before
// it started).
std::unique_ptr<Work> CompletedWork(Status s = Status::Ok());

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // For messages and traces, e.g. "dp[3]".
  virtual std::string name() const { return "comm"; }
  // In place over `count` elements; the result is bitwise identical on every rank.
  virtual std::unique_ptr<Work> AllReduce(float* data, int64_t count, ReduceOp op) = 0;
  // Doubles (norms) and 64-bit integers (token and sample counters). The defaults report
  // Unimplemented; both shipped communicators implement them.
  virtual std::unique_ptr<Work> AllReduce(double* data, int64_t count, ReduceOp op);
  virtual std::unique_ptr<Work> AllReduce(int64_t* data, int64_t count, ReduceOp op);
  // in: size()*count floats; out: this rank's `count` floats of the sum. No overlap.
  virtual std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t count) = 0;
  // in: `count` floats of this rank; out: size()*count floats, rank-major.
  virtual std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t count) = 0;
  // The same over 16-bit elements (bf16 activations; moved as they are, no arithmetic: the result is the bits of an
  // fp32 all-gather rounded afterwards, at half the bytes). In place when `in` is this rank's slot of `out`.
  virtual std::unique_ptr<Work> AllGather16(const uint16_t* in, uint16_t* out, int64_t count) = 0;
  // Sums of bf16 elements (tensor-parallel reductions with parallel.tp_reduce_dtype: bf16: half the bytes of the
  // fp32 ones): every addition rounds to bf16 (the correctly rounded sum of its two bf16 operands, as NCCL's bf16
  // addition), in the communicator's order (Gloo: a ring; NCCL: its own), so with more than 2 ranks the result is
  // not the fp32 sum rounded once and may differ between communicators by the order; with 2 ranks it is exactly
  // round(a + b) everywhere. AllReduce16: in place, bitwise identical on every rank. ReduceScatter16: in size()*count
  // elements, out this rank's `count` elements of the sum, no overlap.
  virtual std::unique_ptr<Work> AllReduce16(uint16_t* data, int64_t count) = 0;
  virtual std::unique_ptr<Work> ReduceScatter16(const uint16_t* in, uint16_t* out, int64_t count) = 0;
  virtual std::unique_ptr<Work> Broadcast(float* data, int64_t count, int root) = 0;
  // Point to point; tag >= 0. Not ordered with collectives (see the Gloo notes above).
  virtual std::unique_ptr<Work> Send(const float* data, int64_t count, int peer, int tag) = 0;
  virtual std::unique_ptr<Work> Recv(float* data, int64_t count, int peer, int tag) = 0;
  // Sends and receives that must progress together (a pipeline stage's send of one micro-batch and its receive
  // for the next, which its neighbour issues the other way round): one Work for all of them. NCCL runs them in
  // one ncclGroupStart/End; the default posts each with Send/Recv (enough where those never block each other:
  // Gloo) and waits for all.
  virtual std::unique_ptr<Work> GroupP2p(const std::vector<P2pOp>& ops);
  // Whether sends and receives of this communicator run in issue order on one stream, each blocking the ones
  // after it until its peer has matched it (NCCL): then a receive must not be posted ahead of a send the peer
  // needs first, and crossing sends/receives must go through GroupP2p.
  virtual bool p2p_in_order() const { return false; }
  // Whether an operation is ordered after the compute that produced its buffer without a host synchronization
  // (NCCL communicators wait on the device for the backend's stream), so callers may skip Synchronize().
  virtual bool orders_after_compute() const { return false; }
  // Whether Work::WaitOnDevice leaves the host free (NCCL); false: it is Wait().
  virtual bool waits_on_device() const { return false; }
  // Blocks until every operation waited on the device (Work::WaitOnDevice) has completed, and returns the first
  // failure of the communicator (its watchdog's timeout, a peer's failure). What a caller does before it relies on
  // results computed after device waits (the end of a training step). Default: OK (nothing is waited on the device).
  virtual Status Drain() { return Status::Ok(); }
  // The time the backend's stream spent blocked in this communicator's device waits (Work::WaitOnDevice) that ended
  // since the last call, measured on the device (timing events around each wait): the communication the compute did
  // not hide, where the host no longer sees it. 0 where nothing is waited on the device.
  virtual double TakeDeviceWaitSeconds() { return 0; }
  // Where operations are waited on the device: watches the work enqueued on the backend's stream so far (a CUDA graph
  // launched there whose captured operations of this communicator no Work represents) as one such operation —
  // Drain waits for it, the watchdog times it out and aborts (`what` names it). Default: nothing to watch.
  virtual Status WatchCompute(const std::string& /*what*/) { return Status::Ok(); }
  // Ordered after every collective issued before it; blocks until all ranks arrive.
  virtual Status Barrier() = 0;
};

// A communicator that forwards every call to another (not owned), passing each operation's Work through Wrap: the
// base of the wrappers that time, track or count waits. `call_start` (NowSeconds()) is when the forwarded call began,
// `op` names the operation ("all-reduce", "send", ...).
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(Communicator* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  std::unique_ptr<Work> AllReduce(float* d, int64_t n, ReduceOp op) override {
    return Fwd("all-reduce", [&] { return inner_->AllReduce(d, n, op); });
  }
  std::unique_ptr<Work> AllReduce(double* d, int64_t n, ReduceOp op) override {
    return Fwd("all-reduce", [&] { return inner_->AllReduce(d, n, op); });
  }
  std::unique_ptr<Work> AllReduce(int64_t* d, int64_t n, ReduceOp op) override {
    return Fwd("all-reduce", [&] { return inner_->AllReduce(d, n, op); });
  }
  std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t n) override {
    return Fwd("reduce-scatter", [&] { return inner_->ReduceScatter(in, out, n); });
  }
  std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t n) override {
    return Fwd("all-gather", [&] { return inner_->AllGather(in, out, n); });
  }
  std::unique_ptr<Work> AllGather16(const uint16_t* in, uint16_t* out, int64_t n) override {
    return Fwd("all-gather", [&] { return inner_->AllGather16(in, out, n); });
  }
  std::unique_ptr<Work> AllReduce16(uint16_t* d, int64_t n) override {
    return Fwd("all-reduce", [&] { return inner_->AllReduce16(d, n); });
  }
  std::unique_ptr<Work> ReduceScatter16(const uint16_t* in, uint16_t* out, int64_t n) override {
    return Fwd("reduce-scatter", [&] { return inner_->ReduceScatter16(in, out, n); });
  }
  std::unique_ptr<Work> Broadcast(float* d, int64_t n, int root) override {
    return Fwd("broadcast", [&] { return inner_->Broadcast(d, n, root); });
  }
  std::unique_ptr<Work> Send(const float* d, int64_t n, int peer, int tag) override {
    return Fwd("send", [&] { return inner_->Send(d, n, peer, tag); });
  }
  std::unique_ptr<Work> Recv(float* d, int64_t n, int peer, int tag) override {
    return Fwd("recv", [&] { return inner_->Recv(d, n, peer, tag); });
  }
  std::unique_ptr<Work> GroupP2p(const std::vector<P2pOp>& ops) override {
    return Fwd("send/recv", [&] { return inner_->GroupP2p(ops); });
  }
  bool p2p_in_order() const override { return inner_->p2p_in_order(); }
  bool orders_after_compute() const override { return inner_->orders_after_compute(); }
  bool waits_on_device() const override { return inner_->waits_on_device(); }
  Status Drain() override { return inner_->Drain(); }
  double TakeDeviceWaitSeconds() override { return inner_->TakeDeviceWaitSeconds(); }
  Status WatchCompute(const std::string& what) override { return inner_->WatchCompute(what); }
  Status Barrier() override { return inner_->Barrier(); }

 protected:
  virtual std::unique_ptr<Work> Wrap(std::unique_ptr<Work> w, const char* op, double call_start) = 0;
  Communicator& inner() const { return *inner_; }

 private:
  template <typename F>
  std::unique_ptr<Work> Fwd(const char* op, F&& call) {
    const double t0 = NowSeconds();
    return Wrap(call(), op, t0);
  }
  Communicator* inner_;
};

// A group of one rank (the 1x1x1 layout, or any group of size 1 in a larger layout).
std::unique_ptr<Communicator> MakeSelfCommunicator();

// ---- Gloo (CPU backend) ------------------------------------------------------------------

struct GlooOptions {
  std::chrono::milliseconds timeout{60'000};  // per collective, and per send/recv Wait()
  std::string name = "gloo";                  // shown in every message, e.g. "dp[3]"
};

// Takes over a connected Gloo context (one communicator per context: they must not be
// shared, since both would use the same tags). Never fails; errors show in the Works.
std::unique_ptr<Communicator> MakeGlooCommunicator(std::shared_ptr<gloo::Context> context, GlooOptions options);

// A TCP transport device listening on `hostname` (an address or name of this host; empty:
// resolve this machine's hostname). One device serves any number of contexts.
//
// The device's event-loop thread (Gloo's: it reads every socket of the device) is made SCHED_BATCH, which only
// takes away its wakeup preemption. Without it, on a host with more busy threads than cores, the loop woke on a
// message, preempted the thread that held that connection's lock (a send or receive being posted), and — Gloo
// only try-locks there and epoll is level-triggered — spun on epoll_wait for the rest of its time slice: 99% of
// its calls failed the lock, and an 8-rank job on 2 cores spent 35 s of system time in 27 s (7 s with it;
// docs/PERFORMANCE.md, "Gloo's event loop"). MEGASCALE_GLOO_LOOP=normal leaves the thread as it was. `loop_note`
// (optional) receives what was done, for the log.
Result<std::shared_ptr<gloo::transport::Device>> MakeGlooTcpDevice(const std::string& hostname,
                                                                   std::string* loop_note = nullptr);

// Connects `rank` of `size` to every other rank through `store` (give each group its own
// key space, e.g. with gloo::rendezvous::PrefixStore). Blocks until every rank has
// connected or `timeout` passes; Unavailable/Timeout with the group name on failure.
Result<std::shared_ptr<gloo::Context>> ConnectGlooContext(gloo::rendezvous::Store& store, int rank, int size,
                                                          std::shared_ptr<gloo::transport::Device> device,
                                                          std::chrono::milliseconds timeout,
                                                          std::string_view group_name);

}  // namespace ms::comm
