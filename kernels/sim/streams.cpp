// kernels/sim/streams.cpp: the emulated device's streams and events (see runtime_hooks.h, StreamMode).
//
// sync     every operation runs at once on the calling thread (streams are trivially in order; a missing
//          synchronization is never visible). The default, and what the kernel tests use.
// async    every stream has its own worker thread that runs the stream's operations in issue order,
//          concurrently with the host and with the other streams; the only orderings are the ones CUDA
//          guarantees: issue order within a stream, cudaStreamWaitEvent, the legacy default stream's implicit
//          barrier with blocking streams, and host synchronization. An operation may block its stream (the
//          emulated NCCL's receives do), exactly as an NCCL kernel blocks a GPU stream.
// deferred async, and a stream runs an operation only once something needs it: a host synchronization
//          (stream, event, device, a blocking copy), or another stream's cudaStreamWaitEvent on an event
//          recorded after it. Streams marked eager (SetStreamEager: NCCL's) run as soon as they can. So work is
//          reordered as far as CUDA allows, and a consumer that forgot to wait for its producer reads stale
//          memory instead of, by luck, memory written in time.
// All bookkeeping is under one mutex with one condition variable (a handful of streams per process).
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "sim/internal.h"
#include "sim/runtime_hooks.h"

namespace ms::sim {
namespace internal {
namespace {

struct StreamState;

// A captured or instantiated graph: its operations in issue order. A capture may span streams, as CUDA's does: a
// stream that waits for an event recorded in the capture joins it (a fork), and its operations are captured too;
// every such stream must be joined back — an event recorded on it after its last captured operation waited for by
// the origin stream, directly or through other streams of the capture — before the origin ends the capture
// (cudaErrorStreamCaptureUnjoined otherwise). Each operation keeps its lane: 0 for the origin stream's, k for the
// k-th forked stream's. A launch (async and deferred modes) runs lane 0 on the launching stream and every other lane
// on a stream of the executable graph's own, each lane's operations in their order and each fork and join as a
// dependency between lanes — concurrently, as a GPU runs a graph's branches (a wait captured in one lane blocks that
// lane only, not another lane's operations issued after it); the launching stream's next operation waits for every
// lane. In sync mode, and when a graph is launched into a capture, the operations run one after the other in the
// order they were issued: a valid order of the graph's dependencies (each was issued after the ones it depends on).
struct GraphState {
  std::vector<std::pair<std::string, StreamOp>> ops;
  std::vector<uint32_t> op_lane;     // per operation: its lane
  bool invalid = false;              // while capturing: something CUDA refuses happened
  std::string why;                   // the first reason it was invalidated
  std::thread::id thread;            // the thread that began the capture
  bool thread_local_mode = false;    // cudaStreamCaptureModeThreadLocal: only that thread may end it
  StreamState* origin = nullptr;     // the stream that began the capture
  std::vector<StreamState*> forked;  // streams that joined it by waiting for one of its events
  // The first `upto` operations captured on `from` precede the operation issued on `into` after its first `at`.
  struct Join {
    StreamState* from;
    uint64_t upto;
    StreamState* into;
    uint64_t at;
  };
  std::vector<Join> joins;  // forks too: a forked stream's first operation after the event it waited for
  // Made at the end of the capture: the joins between lanes, and whether each lane's stream was eager (NCCL's).
  struct LaneJoin {
    uint32_t from;
    uint64_t upto;
    uint32_t into;
    uint64_t at;
  };
  std::vector<LaneJoin> lane_joins;
  std::vector<bool> lane_eager;  // one per lane; lane 0's unused
  // An executable graph's streams for lanes 1.. (made at its first launch, destroyed with it); [0] unused.
  std::vector<StreamState*> lane_streams;
};

struct Item {
  uint64_t seq = 0;
  std::string what;
  StreamOp op;
  std::vector<std::pair<StreamState*, uint64_t>> deps;  // (stream, seq) that must have run first
};

struct StreamState {
  bool blocking = true;  // created without cudaStreamNonBlocking (or the legacy stream)
  bool eager = false;
  bool legacy = false;
  std::deque<Item> queue;
  uint64_t enqueued = 0, done = 0, demanded = 0;
  cudaError_t sticky = cudaSuccess;  // the first failure of an operation run on the stream
  GraphState* capture = nullptr;     // between cudaStreamBeginCapture and cudaStreamEndCapture (or forked into one)
  uint64_t captured = 0;             // operations captured on this stream in its current capture
  uint32_t lane = 0;                 // its lane in that capture (GraphState)
  bool stop = false;
  std::thread worker;
};

struct EventState {
  StreamState* stream = nullptr;  // where it was last recorded (async modes)
  uint64_t seq = 0;
  std::chrono::steady_clock::time_point time;
  bool recorded = false;
  GraphState* captured_in = nullptr;  // last recorded on a capturing stream (until recorded again elsewhere)
};

struct Engine {
  std::mutex mu;
  std::condition_variable cv;
  StreamMode mode = StreamMode::kSync;
  bool mode_read = false;
  std::set<StreamState*> streams;  // live streams (the legacy stream included once it exists)
  std::set<EventState*> events;
  StreamState* legacy = nullptr;
  std::set<GraphState*> captures;  // active captures
  std::set<GraphState*> graphs;    // cudaGraph_t and cudaGraphExec_t handles alive
};

Engine& E() {
  static Engine* e = new Engine;  // never destroyed: streams may outlive static destructors
  return *e;
}

StreamMode ReadModeLocked(Engine& e) {
  if (!e.mode_read) {
    e.mode_read = true;
    const char* m = std::getenv("MS_SIM_STREAMS");
    if (m && std::strcmp(m, "async") == 0) e.mode = StreamMode::kAsync;
    if (m && std::strcmp(m, "deferred") == 0) e.mode = StreamMode::kDeferred;
  }
  return e.mode;
}

void WorkerLoop(StreamState* s);

void StartWorkerLocked(StreamState* s) {
  if (!s->worker.joinable()) s->worker = std::thread(WorkerLoop, s);
}

StreamState* LegacyLocked(Engine& e) {
  if (!e.legacy) {
    e.legacy = new StreamState;
    e.legacy->legacy = true;
    e.streams.insert(e.legacy);
  }
  return e.legacy;
}

StreamState* Resolve(Engine& e, cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) return LegacyLocked(e);
  auto* s = reinterpret_cast<StreamState*>(stream);
  return e.streams.count(s) ? s : nullptr;
}

void DemandLocked(Engine& e, StreamState* s, uint64_t seq) {
  if (s->demanded < seq) {
    s->demanded = seq;
    e.cv.notify_all();
  }
}

bool Runnable(const Engine& e, const StreamState* s) {
  if (s->queue.empty()) return false;
  return e.mode != StreamMode::kDeferred || s->eager || s->queue.front().seq <= s->demanded;
}

void WorkerLoop(StreamState* s) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  for (;;) {
    e.cv.wait(lock, [&] { return Runnable(e, s) || (s->stop && s->queue.empty()); });
    if (s->queue.empty()) return;  // stopping
    Item& it = s->queue.front();
    for (auto& [dep, seq] : it.deps) {
      if (!e.streams.count(dep)) continue;  // destroyed: everything on it has run
      DemandLocked(e, dep, seq);
      e.cv.wait(lock, [&] { return !e.streams.count(dep) || dep->done >= seq; });
    }
    StreamOp op = std::move(it.op);
    const uint64_t seq = it.seq;
    lock.unlock();
    const cudaError_t r = op ? op() : cudaSuccess;
    lock.lock();
    if (r != cudaSuccess && s->sticky == cudaSuccess) s->sticky = r;
    s->queue.pop_front();
    s->done = seq;
    e.cv.notify_all();
  }
}

// Waits (host) until `s` has run everything up to `seq`; its sticky error, if any.
// The lock is released while waiting, so another thread may retire s meanwhile (RetireLocked, which waits for s's work
// first and deletes it under the lock): s is read only while it is still live.
cudaError_t WaitLocked(Engine& e, std::unique_lock<std::mutex>& lock, StreamState* s, uint64_t seq) {
  DemandLocked(e, s, seq);
  bool live = true;
  e.cv.wait(lock, [&] {
    live = e.streams.count(s) > 0;
    return !live || s->done >= seq;
  });
  return live ? s->sticky : cudaSuccess;
}

// The legacy stream's implicit barrier: work on it waits for all blocking streams, and work on a blocking
// stream waits for the legacy stream.
std::vector<std::pair<StreamState*, uint64_t>> ImplicitDepsLocked(Engine& e, StreamState* s) {
  std::vector<std::pair<StreamState*, uint64_t>> deps;
  if (s->legacy) {
    for (StreamState* o : e.streams) {
      if (o != s && o->blocking && o->enqueued > o->done) deps.emplace_back(o, o->enqueued);
    }
  } else if (s->blocking && e.legacy && e.legacy->enqueued > e.legacy->done) {
    deps.emplace_back(e.legacy, e.legacy->enqueued);
  }
  return deps;
}

cudaError_t EnqueueLocked(Engine& e, StreamState* s, const char* what, StreamOp op,
                          std::vector<std::pair<StreamState*, uint64_t>> deps, uint64_t* seq_out = nullptr) {
  auto implicit = ImplicitDepsLocked(e, s);
  deps.insert(deps.end(), implicit.begin(), implicit.end());
  Item it;
  it.seq = ++s->enqueued;
  it.what = what;
  it.op = std::move(op);
  it.deps = std::move(deps);
  s->queue.push_back(std::move(it));
  if (seq_out) *seq_out = s->enqueued;
  StartWorkerLocked(s);
  e.cv.notify_all();
  return cudaSuccess;
}

// Destroys a stream: CUDA lets the work already enqueued finish; the emulator waits for it (so no worker outlives its
// stream), then stops and joins its worker. Returns with the lock held again.
void RetireLocked(Engine& e, std::unique_lock<std::mutex>& lock, StreamState* s) {
  WaitLocked(e, lock, s, s->enqueued);
  e.streams.erase(s);
  s->stop = true;
  e.cv.notify_all();
  std::thread worker = std::move(s->worker);
  lock.unlock();
  if (worker.joinable()) worker.join();
  lock.lock();
  delete s;  // under the lock: a waiter on s (WaitLocked) sees it gone from e.streams, never freed memory
}

void InvalidateLocked(GraphState* g, const std::string& why) {
  if (!g->invalid) {
    g->invalid = true;
    g->why = why;
  }
}

// An event last recorded in a capture: CUDA refuses to query, synchronize or time it (and invalidates the capture
// while it lasts).
cudaError_t CapturedEventLocked(Engine& e, EventState* ev, const char* api) {
  if (e.captures.count(ev->captured_in)) InvalidateLocked(ev->captured_in, std::string(api) + " of a captured event");
  return cudaErrorCapturedEvent;
}

}  // namespace

bool AsyncStreams() {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  return ReadModeLocked(e) != StreamMode::kSync;
}

bool KnownStreamHandle(cudaStream_t stream) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  return Resolve(e, stream) != nullptr;
}

bool KnownEventHandle(cudaEvent_t event) {
  if (!event) return false;
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  return e.events.count(reinterpret_cast<EventState*>(event)) != 0;
}

cudaStream_t NewStream(bool blocking) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* s = new StreamState;
  s->blocking = blocking;
  e.streams.insert(s);
  return reinterpret_cast<cudaStream_t>(s);
}

cudaError_t DestroyStream(cudaStream_t stream) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  auto* s = reinterpret_cast<StreamState*>(stream);
  if (stream == nullptr || !e.streams.count(s) || s->legacy) return cudaErrorInvalidResourceHandle;
  if (s->capture) return cudaErrorStreamCaptureUnsupported;  // end the capture first
  RetireLocked(e, lock, s);
  return cudaSuccess;
}

cudaError_t Enqueue(cudaStream_t stream, const char* what, StreamOp op) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (s->capture) {
    if (s->capture->invalid) return cudaErrorStreamCaptureInvalidated;
    s->capture->ops.emplace_back(what, std::move(op));
    s->capture->op_lane.push_back(s->lane);
    ++s->captured;
    return cudaSuccess;
  }
  if (s->legacy && !e.captures.empty()) {  // the legacy stream's barrier would join a capturing blocking stream
    for (StreamState* o : e.streams) {
      if (o->capture && o->blocking) {
        InvalidateLocked(o->capture, std::string(what) + " on the legacy stream while a blocking stream captures");
        return cudaErrorStreamCaptureImplicit;
      }
    }
  }
  if (ReadModeLocked(e) == StreamMode::kSync) {
    lock.unlock();
    return op();
  }
  return EnqueueLocked(e, s, what, std::move(op), {});
}

cudaError_t SynchronizeStream(cudaStream_t stream) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (s->capture) {
    InvalidateLocked(s->capture, "cudaStreamSynchronize of the capturing stream");
    return cudaErrorStreamCaptureUnsupported;
  }
  if (s->legacy) {  // the legacy stream also waits for every blocking stream
    for (StreamState* o : std::vector<StreamState*>(e.streams.begin(), e.streams.end())) {
      if (e.streams.count(o) && o->blocking) {  // (one retired while an earlier wait released the lock: gone)
        if (cudaError_t r = WaitLocked(e, lock, o, o->enqueued); r != cudaSuccess) return r;
      }
    }
  }
  return WaitLocked(e, lock, s, s->enqueued);
}

cudaError_t QueryStream(cudaStream_t stream) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (s->capture) {
    InvalidateLocked(s->capture, "cudaStreamQuery of the capturing stream");
    return cudaErrorStreamCaptureUnsupported;
  }
  DemandLocked(e, s, s->enqueued);
  if (s->sticky != cudaSuccess) return s->sticky;
  return s->done >= s->enqueued ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t SynchronizeDevice() {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  for (GraphState* g : e.captures) {
    if (g->thread == std::this_thread::get_id()) {  // thread-local and global modes: not from the capturing thread
      InvalidateLocked(g, "cudaDeviceSynchronize by the capturing thread");
      return cudaErrorStreamCaptureUnsupported;
    }
  }
  cudaError_t first = cudaSuccess;
  for (StreamState* o : std::vector<StreamState*>(e.streams.begin(), e.streams.end())) {
    if (e.streams.count(o) == 0) continue;  // retired while an earlier wait released the lock
    const cudaError_t r = WaitLocked(e, lock, o, o->enqueued);
    if (first == cudaSuccess) first = r;
  }
  return first;
}

cudaEvent_t NewEvent() {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* ev = new EventState;
  e.events.insert(ev);
  return reinterpret_cast<cudaEvent_t>(ev);
}

cudaError_t DestroyEvent(cudaEvent_t event) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  if (!e.events.erase(ev)) return cudaErrorInvalidResourceHandle;
  // Operations that captured it (waits) hold the stream and sequence, not the event: freeing is safe.
  delete ev;
  return cudaSuccess;
}

cudaError_t RecordEvent(cudaEvent_t event, cudaStream_t stream) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  StreamState* s = Resolve(e, stream);
  if (!s || !e.events.count(ev)) return cudaErrorInvalidResourceHandle;
  if (s->capture) {  // a point in the capture: other operations of the capture may wait for it, nothing else
    if (s->capture->invalid) return cudaErrorStreamCaptureInvalidated;
    ev->captured_in = s->capture;
    ev->stream = s;
    ev->seq = s->captured;  // in the capture: after the stream's first `captured` operations
    return cudaSuccess;
  }
  ev->captured_in = nullptr;
  if (ReadModeLocked(e) == StreamMode::kSync) {
    ev->time = std::chrono::steady_clock::now();
    ev->recorded = true;
    return cudaSuccess;
  }
  ev->recorded = false;
  uint64_t seq = 0;
  EnqueueLocked(
      e, s, "cudaEventRecord",
      [ev]() {
        // The event may have been destroyed meanwhile (allowed by CUDA): only touch it if it is still live.
        Engine& en = E();
        std::lock_guard<std::mutex> l(en.mu);
        if (en.events.count(ev)) {
          ev->time = std::chrono::steady_clock::now();
          ev->recorded = true;
        }
        return cudaSuccess;
      },
      {}, &seq);
  ev->stream = s;
  ev->seq = seq;
  return cudaSuccess;
}

cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  StreamState* s = Resolve(e, stream);
  if (!s || !e.events.count(ev)) return cudaErrorInvalidResourceHandle;
  if (ev->captured_in || s->capture) {
    GraphState* g = ev->captured_in;
    if (g && g == s->capture) {  // an event of the same capture: a dependency inside the graph
      if (ev->stream != s) g->joins.push_back({ev->stream, ev->seq, s, s->captured});
      return cudaSuccess;
    }
    if (s->capture) {
      InvalidateLocked(s->capture, "the capturing stream waited for an event recorded outside the capture");
      return cudaErrorStreamCaptureIsolation;
    }
    if (e.captures.count(g) && !s->legacy) {  // a fork: the stream joins the capture
      if (g->invalid) return cudaErrorStreamCaptureInvalidated;
      s->capture = g;
      s->captured = 0;
      g->forked.push_back(s);
      s->lane = static_cast<uint32_t>(g->forked.size());
      g->joins.push_back({ev->stream, ev->seq, s, 0});  // its operations come after the event's point
      return cudaSuccess;
    }
    if (e.captures.count(g)) InvalidateLocked(g, "the legacy stream waited for an event recorded in the capture");
    return cudaErrorStreamCaptureUnsupported;
  }
  if (ReadModeLocked(e) == StreamMode::kSync || !ev->stream || ev->stream == s) return cudaSuccess;
  if (!e.streams.count(ev->stream)) return cudaSuccess;  // its stream is gone: everything on it has run
  return EnqueueLocked(e, s, "cudaStreamWaitEvent", nullptr, {{ev->stream, ev->seq}});
}

cudaError_t SynchronizeEvent(cudaEvent_t event) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  if (!e.events.count(ev)) return cudaErrorInvalidResourceHandle;
  if (ev->captured_in) return CapturedEventLocked(e, ev, "cudaEventSynchronize");
  if (!ev->stream || !e.streams.count(ev->stream)) return cudaSuccess;
  return WaitLocked(e, lock, ev->stream, ev->seq);
}

cudaError_t QueryEvent(cudaEvent_t event) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  if (!e.events.count(ev)) return cudaErrorInvalidResourceHandle;
  if (ev->captured_in) return CapturedEventLocked(e, ev, "cudaEventQuery");
  if (!ev->stream || !e.streams.count(ev->stream)) return cudaSuccess;
  DemandLocked(e, ev->stream, ev->seq);  // a GPU always makes progress: polling must too
  if (ev->stream->done < ev->seq) return cudaErrorNotReady;
  return ev->stream->sticky;
}

cudaError_t RefuseInCapture(cudaStream_t stream, const std::string& why) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s || !s->capture) return cudaSuccess;
  InvalidateLocked(s->capture, why);
  return cudaErrorStreamCaptureUnsupported;
}

bool AnyCapture() {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  return !e.captures.empty();
}

cudaError_t BeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  if (s->legacy) return cudaErrorStreamCaptureUnsupported;  // CUDA cannot capture the legacy stream
  if (s->capture) return cudaErrorIllegalState;
  auto* g = new GraphState;
  g->thread = std::this_thread::get_id();
  g->thread_local_mode = mode == cudaStreamCaptureModeThreadLocal;
  g->origin = s;
  s->capture = g;
  s->captured = 0;
  s->lane = 0;
  e.captures.insert(g);
  return cudaSuccess;
}

cudaError_t EndCapture(cudaStream_t stream, cudaGraph_t* graph, std::string* why) {
  static GraphState ended;  // what events recorded in a finished capture point at
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  GraphState* g = s->capture;
  if (!g) return cudaErrorIllegalState;
  if (g->thread_local_mode && g->thread != std::this_thread::get_id()) return cudaErrorStreamCaptureWrongThread;
  if (g->origin != s) {  // only the stream that began it may end it
    InvalidateLocked(g, "cudaStreamEndCapture on a stream forked into the capture, not the one that began it");
    return cudaErrorStreamCaptureUnmatched;
  }
  // Every forked stream joined back: how far each stream's captured operations precede the origin's end.
  std::map<StreamState*, uint64_t> joined{{s, UINT64_MAX}};
  for (bool changed = true; changed;) {
    changed = false;
    for (const GraphState::Join& j : g->joins) {
      auto into = joined.find(j.into);
      if (into == joined.end() || into->second < j.at) continue;
      uint64_t& from = joined[j.from];
      if (from < j.upto) {
        from = j.upto;
        changed = true;
      }
    }
  }
  std::map<StreamState*, uint32_t> lane_of{{s, 0}};
  g->lane_eager.assign(1, false);
  for (StreamState* f : g->forked) {
    lane_of[f] = f->lane;
    g->lane_eager.push_back(f->eager);
  }
  for (const GraphState::Join& j : g->joins) {
    auto from = lane_of.find(j.from), into = lane_of.find(j.into);
    if (from != lane_of.end() && into != lane_of.end()) {
      g->lane_joins.push_back({from->second, j.upto, into->second, j.at});
    }
  }
  cudaError_t unjoined = cudaSuccess;
  for (StreamState* f : g->forked) {
    if (!g->invalid && joined[f] < f->captured) {
      InvalidateLocked(g, "a stream forked into the capture has operations the origin stream never waited for");
      unjoined = cudaErrorStreamCaptureUnjoined;
    }
    f->capture = nullptr;
  }
  s->capture = nullptr;
  e.captures.erase(g);
  for (EventState* ev : e.events) {
    if (ev->captured_in == g) ev->captured_in = &ended;
  }
  *graph = nullptr;
  if (g->invalid) {
    if (why) *why = g->why;
    delete g;
    return unjoined != cudaSuccess ? unjoined : cudaErrorStreamCaptureInvalidated;
  }
  e.graphs.insert(g);
  *graph = reinterpret_cast<cudaGraph_t>(g);
  return cudaSuccess;
}

cudaError_t CaptureStatus(cudaStream_t stream, cudaStreamCaptureStatus* status) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  StreamState* s = Resolve(e, stream);
  if (!s) return cudaErrorInvalidResourceHandle;
  *status = !s->capture           ? cudaStreamCaptureStatusNone
            : s->capture->invalid ? cudaStreamCaptureStatusInvalidated
                                  : cudaStreamCaptureStatusActive;
  return cudaSuccess;
}

cudaError_t CopyGraph(cudaGraph_t graph, void** copy) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* g = reinterpret_cast<GraphState*>(graph);
  if (!e.graphs.count(g)) return cudaErrorInvalidValue;
  auto* c = new GraphState;
  c->ops = g->ops;  // the operations are copies: each launch runs its own
  c->op_lane = g->op_lane;
  c->lane_joins = g->lane_joins;
  c->lane_eager = g->lane_eager;
  e.graphs.insert(c);
  *copy = c;
  return cudaSuccess;
}

cudaError_t GraphOps(cudaGraph_t graph, size_t* n) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* g = reinterpret_cast<GraphState*>(graph);
  if (!e.graphs.count(g)) return cudaErrorInvalidValue;
  *n = g->ops.size();
  return cudaSuccess;
}

cudaError_t DestroyGraph(void* graph) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  auto* g = static_cast<GraphState*>(graph);
  if (!e.graphs.erase(g)) return cudaErrorInvalidValue;
  // Its lanes' streams, after a launch still in flight.
  for (StreamState* ls : g->lane_streams) {
    if (ls) RetireLocked(e, lock, ls);
  }
  delete g;  // operations already issued on a stream hold their own copies
  return cudaSuccess;
}

cudaError_t LaunchGraph(void* exec, cudaStream_t stream) {
  Engine& e = E();
  std::unique_lock<std::mutex> lock(e.mu);
  auto* g = static_cast<GraphState*>(exec);
  StreamState* s = Resolve(e, stream);
  if (!e.graphs.count(g)) return cudaErrorInvalidValue;
  if (!s) return cudaErrorInvalidResourceHandle;
  if (s->capture) {  // a graph launched into a capture becomes part of it
    if (s->capture->invalid) return cudaErrorStreamCaptureInvalidated;
    for (const auto& [what, op] : g->ops) {
      s->capture->ops.emplace_back(what, op);
      s->capture->op_lane.push_back(s->lane);
    }
    s->captured += g->ops.size();
    return cudaSuccess;
  }
  if (ReadModeLocked(e) == StreamMode::kSync) {
    const std::vector<std::pair<std::string, StreamOp>> ops = g->ops;
    lock.unlock();
    for (const auto& [what, op] : ops) {
      if (!op) continue;
      if (cudaError_t r = op(); r != cudaSuccess) return r;
    }
    return cudaSuccess;
  }
  const size_t lanes = std::max<size_t>(g->lane_eager.size(), 1);
  if (g->lane_streams.empty()) {  // the executable graph's streams for lanes 1..
    g->lane_streams.assign(lanes, nullptr);
    for (size_t l = 1; l < lanes; ++l) {
      auto* ls = new StreamState;
      ls->blocking = false;
      ls->eager = g->lane_eager[l];
      e.streams.insert(ls);
      g->lane_streams[l] = ls;
    }
  }
  std::vector<StreamState*> on = g->lane_streams;
  on[0] = s;
  const uint64_t start = s->enqueued;  // the launch begins after what the stream had been given
  std::vector<std::vector<uint64_t>> seqs(lanes);
  // What a point of a lane (after its first `upto` operations) depends on: its operation `upto`, and what the joins
  // into the lane at that very point brought (a wait after the lane's last operation, passed on by an event recorded
  // after it: the lane's later operations and events carry it, as CUDA's do). Joins point only at earlier points.
  std::vector<std::pair<StreamState*, uint64_t>> deps;
  std::function<void(uint32_t, uint64_t, size_t)> point = [&](uint32_t lane, uint64_t upto, size_t depth) {
    if (upto > 0 && upto <= seqs[lane].size()) deps.emplace_back(on[lane], seqs[lane][upto - 1]);
    if (depth > g->lane_joins.size()) return;  // (a chain of joins is never longer)
    for (const GraphState::LaneJoin& j : g->lane_joins) {
      if (j.into == lane && j.at == upto && j.from < lanes) point(j.from, j.upto, depth + 1);
    }
  };
  for (size_t i = 0; i < g->ops.size(); ++i) {
    const uint32_t lane = i < g->op_lane.size() && g->op_lane[i] < lanes ? g->op_lane[i] : 0;
    const uint64_t k = seqs[lane].size();  // the operations of its lane before it
    deps.clear();
    if (lane != 0 && k == 0 && start > 0) deps.emplace_back(s, start);
    for (const GraphState::LaneJoin& j : g->lane_joins) {
      if (j.into == lane && j.at == k && j.from < lanes) point(j.from, j.upto, 0);
    }
    uint64_t seq = 0;
    EnqueueLocked(e, on[lane], "cudaGraphLaunch", g->ops[i].second, std::move(deps), &seq);
    on[lane]->queue.back().what = g->ops[i].first;  // the name outlives the graph: the queue keeps its own string
    seqs[lane].push_back(seq);
  }
  if (lanes > 1) {  // the launch's end on the launching stream: after every lane
    deps.clear();
    for (size_t l = 1; l < lanes; ++l) {
      if (!seqs[l].empty()) deps.emplace_back(on[l], seqs[l].back());
    }
    EnqueueLocked(e, s, "cudaGraphLaunch (end)", nullptr, std::move(deps));
  }
  return cudaSuccess;
}

cudaError_t EventTime(cudaEvent_t event, std::chrono::steady_clock::time_point* t) {
  Engine& e = E();
  std::lock_guard<std::mutex> lock(e.mu);
  auto* ev = reinterpret_cast<EventState*>(event);
  if (!e.events.count(ev)) return cudaErrorInvalidResourceHandle;
  if (ev->captured_in) return CapturedEventLocked(e, ev, "cudaEventElapsedTime");
  if (!ev->recorded) return cudaErrorInvalidResourceHandle;
  *t = ev->time;
  return cudaSuccess;
}

}  // namespace internal

StreamMode GetStreamMode() {
  internal::Engine& e = internal::E();
  std::lock_guard<std::mutex> lock(e.mu);
  return internal::ReadModeLocked(e);
}

void SetStreamMode(StreamMode mode) {
  internal::SynchronizeDevice();  // nothing pending crosses the switch
  internal::Engine& e = internal::E();
  std::lock_guard<std::mutex> lock(e.mu);
  e.mode_read = true;
  e.mode = mode;
  e.cv.notify_all();
}

cudaError_t EnqueueOnStream(cudaStream_t stream, const char* what, StreamOp op) {
  return internal::Enqueue(stream, what, std::move(op));
}

void SetStreamEager(cudaStream_t stream) {
  internal::Engine& e = internal::E();
  std::lock_guard<std::mutex> lock(e.mu);
  if (internal::StreamState* s = internal::Resolve(e, stream)) {
    s->eager = true;
    e.cv.notify_all();
  }
}

const char* StreamModeName(StreamMode mode) {
  switch (mode) {
    case StreamMode::kSync:
      return "sync";
    case StreamMode::kAsync:
      return "async";
    case StreamMode::kDeferred:
      return "deferred";
  }
  return "?";
}

}  // namespace ms::sim
