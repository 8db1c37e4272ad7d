// kernels/sim/simt.cpp: the SIMT emulator's scheduler (see simt.h for the contract): fibers and their
// stacks, the x86-64 context switch, warp-major scheduling, barriers, warp collectives, per-block shared
// memory, and the checks that turn misuse into launch errors.
//
// In the ThreadSanitizer variant this file is compiled WITHOUT -fsanitize=thread but with MS_SIM_TSAN=1:
// the scheduler's own bookkeeping (written by one fiber, read by another) is then invisible to TSan, and
// only the happens-before edges it announces explicitly (block start/end, barriers, warp collectives)
// order the kernel's accesses.
#include <sys/mman.h>
#include <unistd.h>
#include <xmmintrin.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "sim/internal.h"
#include "sim/simt.h"

#if defined(__SANITIZE_ADDRESS__)
#define MS_SIM_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MS_SIM_ASAN 1
#endif
#endif
#ifndef MS_SIM_ASAN
#define MS_SIM_ASAN 0
#endif
#ifndef MS_SIM_TSAN
#define MS_SIM_TSAN 0
#endif

#if MS_SIM_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if MS_SIM_TSAN
#include <sanitizer/tsan_interface.h>
#endif

// ---- context switch -----------------------------------------------------------------------------------
// ms_sim_switch(from, to): saves the callee-saved registers, MXCSR and the x87 control word on the current
// stack, stores the stack pointer in *from, loads to's, restores and returns into it. A new fiber's stack is
// prepared so that the first switch "returns" into ms_sim_trampoline with r12 = argument, r13 = function.
namespace ms::sim {
struct FiberContext {
  void* sp = nullptr;
};
}  // namespace ms::sim
extern "C" void ms_sim_switch(ms::sim::FiberContext* from, ms::sim::FiberContext* to);
extern "C" void ms_sim_trampoline();
asm(R"(
  .text
  .globl ms_sim_switch
  .hidden ms_sim_switch
  .type ms_sim_switch, @function
ms_sim_switch:
  .cfi_startproc
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $16, %rsp
  stmxcsr 8(%rsp)
  fnstcw (%rsp)
  movq %rsp, (%rdi)
  movq (%rsi), %rsp
  fldcw (%rsp)
  ldmxcsr 8(%rsp)
  addq $16, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .cfi_endproc
  .size ms_sim_switch, .-ms_sim_switch

  .globl ms_sim_trampoline
  .hidden ms_sim_trampoline
  .type ms_sim_trampoline, @function
ms_sim_trampoline:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size ms_sim_trampoline, .-ms_sim_trampoline
)");

namespace ms::sim {
namespace {

constexpr unsigned kWarp = 32;
constexpr size_t kPage = 4096;

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string Format(const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  return buf;
}

std::string Where(const Site& s) {
  return Format("%s:%d", s.file ? s.file : "?", s.line);
}
bool SameSite(const Site& a, const Site& b) {
  return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

size_t StackBytes() {
  const char* env = std::getenv("MS_SIM_STACK_KB");
  if (env && std::atol(env) > 0) return static_cast<size_t>(std::atol(env)) * 1024;
#if MS_SIM_ASAN || MS_SIM_TSAN
  return 512 * 1024;  // sanitizers' frames are large
#else
  return 128 * 1024;
#endif
}

enum class Order { kFwd, kRev, kRand };

// One fiber stack: [guard page | usable bytes], pooled per host thread and reused by thread index.
struct Stack {
  char* map = nullptr;  // the mapping, guard page first
  size_t usable = 0;
  bool dirty = false;  // abandoned mid-run (launch error): ASan's stack shadow must be cleared before reuse
  void* tsan_fiber = nullptr;

  char* bottom() const { return map + kPage; }
  char* top() const { return map + kPage + usable; }
};

enum class State : uint8_t { kRunnable, kBarrier, kCollective, kExited, kFaulted };

struct Thread {
  FiberContext ctx;
  Stack* stack = nullptr;
  State state = State::kRunnable;
  uint3 idx{};
  unsigned linear = 0, warp = 0, lane = 0;
  // The barrier or collective it waits at.
  Site site{};
  Op op = Op::kNone;
  int predicate = 0;
  unsigned mask = 0;
  int arg = 0;
  int width = 32;
  uint64_t value = 0;
  uint64_t result = 0;
  unsigned collectives = 0;        // count, for the TSan sync slot parity
  const WmmaCall* wmma = nullptr;  // at a wmma collective: its call (in the lane's frame)
  std::string wmma_error;          // set when the warp's wmma call completed wrongly: the lane faults
  // Its asynchronous copies not yet waited for, each with its group: the number of groups committed before it.
  struct PendingCopy {
    void* dst;
    const void* src;
    size_t bytes;  // read from src; then zfill zero bytes
    size_t zfill;
    uint64_t group;
  };
  std::vector<PendingCopy> copies;
  uint64_t committed = 0;  // __pipeline_commit calls
#if MS_SIM_TSAN
  char tsan_sync[2] = {0, 0};     // release slots of its partial-mask collectives (alternating)
  unsigned full_collectives = 0;  // its full-mask collectives, for the parity of the warp's slot
  void* tsan_acquire[kWarp] = {};
  unsigned tsan_acquire_count = 0;
#endif
};

struct SharedAlloc {
  Site site;
  size_t bytes;
  void* ptr;
};

// Per host thread: the fiber pool and the state of the running launch/block.
struct Scheduler {
  FiberContext main_ctx;
  const void* main_stack_bottom = nullptr;  // ASan: the launching thread's stack
  size_t main_stack_size = 0;
  void* main_tsan_fiber = nullptr;
  std::vector<std::unique_ptr<Stack>> pool;
  size_t stack_bytes = 0;

  bool in_launch = false;
  const LaunchInfo* info = nullptr;
  void (*invoke)(const void*) = nullptr;
  const void* args = nullptr;
  std::vector<Thread> threads;
  Thread* current = nullptr;
  unsigned nthreads = 0;
  std::vector<SharedAlloc> shared;
  size_t static_shared_bytes = 0;
  void* dynamic_shared = nullptr;
  std::string error;  // non-empty: the block (and launch) failed
  Order order = Order::kFwd;
  std::mt19937 rng;
  unsigned barrier_generation = 0;
#if MS_SIM_TSAN
  char tsan_block_start = 0;
  char tsan_block_end = 0;
  char tsan_barrier[2] = {0, 0};
  char tsan_shared_alloc = 0;
  // Per warp: the release slots of its full-mask collectives (alternating). Every live lane takes part in each of
  // them, so they are ordered and a lane's count of them names the same collective as every other lane's: one
  // release and one acquire per lane, where the per-lane slots (partial masks) cost an acquire of each participant's.
  // ThreadSanitizer's (v2) acquire walks a vector clock as long as the fibers ever created (1024 after a 1024-thread
  // block): 32 of them per lane per shuffle were three quarters of kernels_tsan's time.
  char tsan_warp_sync[1024 / kWarp][2] = {};
#endif

  Stats stats;
  std::string last_error_message;

  ~Scheduler() {
    for (auto& s : pool) {
#if MS_SIM_TSAN
      if (s->tsan_fiber) __tsan_destroy_fiber(s->tsan_fiber);
#endif
      munmap(s->map, kPage + s->usable);
    }
  }
};

thread_local Scheduler tls_sched;

[[noreturn]] void Fatal(const char* what) {
  std::fprintf(stderr, "ms-sim: fatal: %s\n", what);
  std::abort();
}

Stack* GetStack(Scheduler& s, unsigned i) {
  if (s.stack_bytes == 0) s.stack_bytes = (StackBytes() + kPage - 1) / kPage * kPage;
  while (s.pool.size() <= i) {
    auto st = std::make_unique<Stack>();
    st->usable = s.stack_bytes;
    void* m =
        mmap(nullptr, kPage + st->usable, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) Fatal("mmap of a fiber stack failed");
    st->map = static_cast<char*>(m);
    if (mprotect(st->map, kPage, PROT_NONE) != 0) Fatal("mprotect of a fiber stack guard page failed");
#if MS_SIM_TSAN
    st->tsan_fiber = __tsan_create_fiber(0);
#endif
    s.pool.push_back(std::move(st));
  }
  Stack* st = s.pool[i].get();
#if MS_SIM_ASAN
  if (st->dirty) __asan_unpoison_memory_region(st->bottom(), st->usable);
#endif
  st->dirty = false;
  return st;
}

// ---- switching ----

void EnterThread(Scheduler& s, Thread& t) {  // scheduler -> CUDA thread
  threadIdx = t.idx;
  s.current = &t;
  ++s.stats.switches;
#if MS_SIM_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, t.stack->bottom(), t.stack->usable);
#endif
#if MS_SIM_TSAN
  __tsan_switch_to_fiber(t.stack->tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
  ms_sim_switch(&s.main_ctx, &t.ctx);
#if MS_SIM_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  s.current = nullptr;
}

void LeaveThread(Scheduler& s, Thread& t, bool exiting) {  // CUDA thread -> scheduler
#if MS_SIM_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, s.main_stack_bottom, s.main_stack_size);
#else
  (void)exiting;
#endif
#if MS_SIM_TSAN
  __tsan_switch_to_fiber(s.main_tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
  ms_sim_switch(&t.ctx, &s.main_ctx);
#if MS_SIM_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

std::string Dim(uint3 v) {
  return Format("(%u,%u,%u)", v.x, v.y, v.z);
}

std::string Prefix(const Scheduler& s) {
  return Format("kernel %s (launched at %s:%d), block %s", s.info->kernel, s.info->file, s.info->line,
                Dim(blockIdx).c_str());
}
std::string ThreadName(const Thread& t) {
  return Format("thread %s (warp %u lane %u)", Dim(t.idx).c_str(), t.warp, t.lane);
}

// A CUDA thread found misuse at its own call: fail the block and never resume this fiber. printf-style, and no
// std::string may be alive in the caller's frames: an abandoned fiber never runs its destructors (LeakSanitizer).
[[noreturn]] void Fault(const Site& site, const char* fmt, ...) __attribute__((format(printf, 2, 3)));
[[noreturn]] void Fault(const Site& site, const char* fmt, ...) {
  Scheduler& s = tls_sched;
  Thread& t = *s.current;
  {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    s.error = Format("%s, %s at %s: %s", Prefix(s).c_str(), ThreadName(t).c_str(), Where(site).c_str(), what);
  }
  t.state = State::kFaulted;
  LeaveThread(s, t, false);
  std::abort();  // never resumed
}

Thread& CurrentThread(const char* what) {
  Thread* t = tls_sched.current;
  if (!t) {
    std::string msg = Format("%s called outside a kernel launched with MS_LAUNCH", what);
    Fatal(msg.c_str());
  }
  return *t;
}

}  // namespace
}  // namespace ms::sim

// The first code a fiber runs (called by ms_sim_trampoline with the Thread*): one CUDA thread's kernel body.
extern "C" void ms_sim_fiber_main(void* arg) {
  using namespace ms::sim;
  Thread* t = static_cast<Thread*>(arg);
  Scheduler& s = tls_sched;
#if MS_SIM_ASAN
  __sanitizer_finish_switch_fiber(nullptr, &s.main_stack_bottom, &s.main_stack_size);
#endif
#if MS_SIM_TSAN
  __tsan_acquire(&s.tsan_block_start);
#endif
  s.invoke(s.args);
  t->state = State::kExited;
#if MS_SIM_TSAN
  __tsan_release(&s.tsan_block_end);
#endif
  LeaveThread(s, *t, /*exiting=*/true);
  std::abort();  // an exited fiber is never resumed
}

namespace ms::sim {
namespace {

void InitFiber(Thread& t) {
  // Initial frame, read by ms_sim_switch from the saved stack pointer upwards: x87 CW, MXCSR, r15, r14,
  // r13 (function), r12 (argument), rbx, rbp (0: ends frame-pointer unwinding), return address
  // (the trampoline), leaving rsp 16-byte aligned in the trampoline as the ABI requires before a call.
  // Each fiber's frame starts at another of a page's 64 cache lines (the stacks are page-aligned mappings): with
  // every frame at the same page offset, a block's fibers all met in one L1 set, and each switch missed it
  // (an emulated LayerNorm parameter-gradient launch of 1,024 threads: 38 % less time so).
  auto* top = reinterpret_cast<uint64_t*>(t.stack->top() - (t.linear % 64) * 64);
  uint16_t fpu_cw;
  asm volatile("fnstcw %0" : "=m"(fpu_cw));
  top[-1] = 0;
  top[-2] = 0;
  top[-3] = reinterpret_cast<uint64_t>(&ms_sim_trampoline);
  top[-4] = 0;                                               // rbp
  top[-5] = 0;                                               // rbx
  top[-6] = reinterpret_cast<uint64_t>(&t);                  // r12
  top[-7] = reinterpret_cast<uint64_t>(&ms_sim_fiber_main);  // r13
  top[-8] = 0;                                               // r14
  top[-9] = 0;                                               // r15
  top[-10] = _mm_getcsr();                                   // MXCSR (at sp + 8)
  top[-11] = fpu_cw;                                         // x87 control word (at sp)
  t.ctx.sp = &top[-11];
}

Order ReadOrder() {
  const char* env = std::getenv("MS_SIM_SCHEDULE");
  if (!env || !*env || std::strcmp(env, "fwd") == 0) return Order::kFwd;
  if (std::strcmp(env, "rev") == 0) return Order::kRev;
  if (std::strcmp(env, "rand") == 0) return Order::kRand;
  Fatal("MS_SIM_SCHEDULE must be fwd, rev or rand");
}

void MakeOrder(Scheduler& s, std::vector<unsigned>& v, unsigned n) {
  v.resize(n);
  for (unsigned i = 0; i < n; ++i) v[i] = s.order == Order::kRev ? n - 1 - i : i;
  if (s.order == Order::kRand) std::shuffle(v.begin(), v.end(), s.rng);
}

unsigned WarpLanes(const Scheduler& s, unsigned w) {
  return std::min(kWarp, s.nthreads - w * kWarp);
}

bool IsWmma(Op op) {
  return op == Op::kWmmaLoadA || op == Op::kWmmaLoadB || op == Op::kWmmaLoadC || op == Op::kWmmaStore ||
         op == Op::kWmmaMma;
}

const char* WmmaTypeName(WmmaType t) {
  switch (t) {
    case WmmaType::kBf16:
      return "__nv_bfloat16";
    case WmmaType::kHalf:
      return "__half";
    case WmmaType::kFloat:
      return "float";
  }
  return "?";
}
size_t WmmaTypeBytes(WmmaType t) {
  return t == WmmaType::kFloat ? 4 : 2;
}

// mma_sync's arithmetic touches only the emulator's own fixed-size arrays and the lanes' fragment objects, at indices
// bounded by constants: the sanitizers' checks of every element and index (ASan's shadow, UBSan's bounds and
// overflow) kept its loops scalar — a quarter of the sanitizer build's kernel tests (`perf`) — so these three are
// not instrumented. The kernels' own accesses (load_matrix_sync and store_matrix_sync: WmmaLoad, WmmaStore) are.
#define MS_SIM_NO_SANITIZE __attribute__((no_sanitize("address", "undefined")))

MS_SIM_NO_SANITIZE float WmmaGet(const void* x, WmmaType t, int i) {
  switch (t) {
    case WmmaType::kBf16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i]);
    case WmmaType::kHalf:
      return __half2float(static_cast<const __half*>(x)[i]);
    case WmmaType::kFloat:
      return static_cast<const float*>(x)[i];
  }
  return 0.0f;
}
MS_SIM_NO_SANITIZE void WmmaPut(void* x, WmmaType t, int i, float v) {
  switch (t) {
    case WmmaType::kBf16:
      static_cast<__nv_bfloat16*>(x)[i] = __float2bfloat16(v);
      break;
    case WmmaType::kHalf:
      static_cast<__half*>(x)[i] = __float2half(v);
      break;
    case WmmaType::kFloat:
      static_cast<float*>(x)[i] = v;
      break;
  }
}

// d = a * b + c for the 32 lanes of warp w, all waiting in mma_sync: a and b gathered from every lane's
// fragments (the WmmaRow/WmmaCol mapping), then each lane's accumulator elements, accumulated in float
// (c first, then the products in k order), rounded to d's type.
MS_SIM_NO_SANITIZE void WmmaMma(Thread* lanes) {
  float a[kWmmaDim][kWmmaDim], b[kWmmaDim][kWmmaDim];
  const WmmaType ab = lanes[0].wmma->ab_type;
  for (unsigned j = 0; j < kWarp; ++j) {
    const WmmaCall& c = *lanes[j].wmma;
    const int r = WmmaRow(j);
    for (int i = 0; i < kWmmaValuesPerLane; ++i) {
      a[r][WmmaCol(j, i)] = WmmaGet(c.a, ab, i);
      b[r][WmmaCol(j, i)] = WmmaGet(c.b, ab, i);
    }
  }
  // A lane's elements are 8 adjacent columns of its row (WmmaCol(j, i) = WmmaCol(j, 0) + i), so k runs outside
  // and the 8 columns inside: each element still sums c and then its products in k order (the same bits), and the
  // inner loop is one contiguous row of b (vectorized).
  static_assert(kWmmaValuesPerLane == 8 && WmmaCol(1, 7) == WmmaCol(1, 0) + 7, "the lane layout changed");
  for (unsigned j = 0; j < kWarp; ++j) {
    const WmmaCall& c = *lanes[j].wmma;
    const int r = WmmaRow(j);
    const int col0 = WmmaCol(j, 0);
    float acc[kWmmaValuesPerLane];
    for (int i = 0; i < kWmmaValuesPerLane; ++i) acc[i] = WmmaGet(c.c, c.type, i);
    for (int k = 0; k < kWmmaDim; ++k) {
      const float ak = a[r][k];
      for (int i = 0; i < kWmmaValuesPerLane; ++i) acc[i] += ak * b[k][col0 + i];
    }
    for (int i = 0; i < kWmmaValuesPerLane; ++i) WmmaPut(c.d, c.d_type, i, acc[i]);  // d may be c
  }
}

// A wmma collective of warp w completed with `group`: it must be the whole warp, from one call site, with
// the same arguments in every lane; then mma_sync is computed. Otherwise every lane gets the error, and
// the first to run faults with it.
void CompleteWmma(Scheduler& s, unsigned w, unsigned group) {
  Thread* lanes = &s.threads[w * kWarp];
  std::string problem;
  if (group != 0xffffffffu) {
    const unsigned gone = static_cast<unsigned>(__builtin_ctz(~group));
    problem = Format("%s: lane %u of the warp (%s) has exited; all 32 lanes of a warp must call it",
                     OpName(lanes[__builtin_ctz(group)].op), gone, ThreadName(lanes[gone]).c_str());
  } else {
    const Thread& t0 = lanes[0];
    const WmmaCall& c0 = *t0.wmma;
    for (unsigned j = 1; j < kWarp && problem.empty(); ++j) {
      const Thread& t = lanes[j];
      const WmmaCall& c = *t.wmma;
      if (!SameSite(t.site, t0.site)) {
        problem = Format("%s: lane 0 calls it at %s, lane %u at %s; the lanes of a warp must execute the same call",
                         OpName(t.op), Where(t0.site).c_str(), j, Where(t.site).c_str());
      } else if (c.mem != c0.mem || c.ldm != c0.ldm || c.col_major != c0.col_major || c.type != c0.type ||
                 c.ab_type != c0.ab_type || c.d_type != c0.d_type) {
        problem = Format(
            "%s: lane 0 passes (pointer %p, ldm %u, %s) but lane %u (pointer %p, ldm %u, %s); every lane of the "
            "warp must pass the same matrix",
            OpName(t.op), c0.mem, c0.ldm, c0.col_major ? "col-major" : "row-major", j, c.mem, c.ldm,
            c.col_major ? "col-major" : "row-major");
      }
    }
    if (problem.empty() && t0.op == Op::kWmmaMma) WmmaMma(lanes);
  }
  if (problem.empty()) return;
  for (unsigned i = 0; i < kWarp; ++i) {
    if (group >> i & 1u) lanes[i].wmma_error = problem;
  }
}

// Completes the collective of `group` (lanes of warp w, all at the same op with the same mask and width).
void Complete(Scheduler& s, unsigned w, unsigned group) {
  Thread* lanes = &s.threads[w * kWarp];
  const unsigned n = WarpLanes(s, w);
  const unsigned first = static_cast<unsigned>(__builtin_ctz(group));
  const Op op = lanes[first].op;
  if (IsWmma(op)) CompleteWmma(s, w, group);
  unsigned votes = 0;
  for (unsigned j = 0; j < n; ++j) {
    if ((group >> j & 1u) && lanes[j].value != 0) votes |= 1u << j;
  }
  for (unsigned i = 0; i < n; ++i) {
    if (!(group >> i & 1u)) continue;
    Thread& t = lanes[i];
    const unsigned width = static_cast<unsigned>(t.width);
    const unsigned seg = i & ~(width - 1);
    const unsigned arg = static_cast<unsigned>(t.arg);
    unsigned src = i;
    switch (op) {
      case Op::kShflIdx:
        src = seg + (arg & (width - 1));
        break;
      case Op::kShflUp:
        src = i - seg >= arg ? i - arg : i;
        break;
      case Op::kShflDown:
        src = i - seg + arg < width ? i + arg : i;
        break;
      case Op::kShflXor:
        src = (i ^ arg) < seg + width ? (i ^ arg) : i;
        break;
      default:
        break;
    }
    switch (op) {
      case Op::kShflIdx:
      case Op::kShflUp:
      case Op::kShflDown:
      case Op::kShflXor:
        if (src < kWarp && (group >> src & 1u)) {
          t.result = lanes[src].value;
        } else {
          t.result = ~uint64_t{0};  // inactive, exited or nonexistent source lane: undefined on the GPU
          ++s.stats.poisoned_reads;
        }
        break;
      case Op::kBallot:
        t.result = votes;
        break;
      case Op::kAny:
        t.result = votes != 0;
        break;
      case Op::kAll:
        t.result = votes == group;
        break;
      default:
        t.result = 0;
        break;
    }
#if MS_SIM_TSAN
    t.tsan_acquire_count = 0;
    for (unsigned j = 0; j < n; ++j) {
      if (group >> j & 1u) t.tsan_acquire[t.tsan_acquire_count++] = &lanes[j].tsan_sync[lanes[j].collectives & 1];
    }
#endif
  }
  for (unsigned i = 0; i < n; ++i) {
    if (group >> i & 1u) lanes[i].state = State::kRunnable;
  }
}

// Completes every collective of warp w whose named lanes have all arrived (or exited). Returns whether any.
bool ResolveCollectives(Scheduler& s, unsigned w) {
  Thread* lanes = &s.threads[w * kWarp];
  const unsigned n = WarpLanes(s, w);
  bool any = false;
  for (unsigned i = 0; i < n; ++i) {
    const Thread& t = lanes[i];
    if (t.state != State::kCollective) continue;
    unsigned group = 0;
    bool ready = true;
    for (unsigned j = 0; j < n && ready; ++j) {
      if (!(t.mask >> j & 1u)) continue;
      const Thread& u = lanes[j];
      if (u.state == State::kExited) continue;
      if (u.state == State::kCollective && u.op == t.op && u.mask == t.mask && u.width == t.width) {
        group |= 1u << j;
      } else {
        ready = false;
      }
    }
    if (ready) {
      Complete(s, w, group);
      any = true;
    }
  }
  return any;
}

// Runs warp w until none of its lanes can make progress. Returns false on error.
bool RunWarp(Scheduler& s, unsigned w, std::vector<unsigned>& order) {
  const unsigned n = WarpLanes(s, w);
  for (;;) {
    bool progressed = false;
    MakeOrder(s, order, n);
    for (unsigned lane : order) {
      Thread& t = s.threads[w * kWarp + lane];
      if (t.state != State::kRunnable) continue;
      EnterThread(s, t);
      progressed = true;
      if (!s.error.empty()) return false;
    }
    if (ResolveCollectives(s, w)) progressed = true;
    if (!progressed) return true;
  }
}

// Every warp is stuck: a block barrier to release, the end of the block, or an error.
// Returns true when the block has finished.
bool ResolveBlock(Scheduler& s) {
  const Thread* exited = nullptr;
  const Thread* waiting = nullptr;
  for (const Thread& t : s.threads) {
    if (t.state == State::kCollective) {
      // Its collective can never complete: find the lane that blocks it.
      const Thread* lanes = &s.threads[t.warp * kWarp];
      const unsigned n = WarpLanes(s, t.warp);
      for (unsigned j = 0; j < n; ++j) {
        const Thread& u = lanes[j];
        if (!(t.mask >> j & 1u) || &u == &t || u.state == State::kExited) continue;
        if (u.state == State::kBarrier) {
          s.error = Format(
              "%s: deadlock: %s waits in %s (mask 0x%08x) at %s, but lane %u of its mask, %s, waits at %s "
              "(%s); a collective's lanes must all reach it",
              Prefix(s).c_str(), ThreadName(t).c_str(), OpName(t.op), t.mask, Where(t.site).c_str(), j,
              ThreadName(u).c_str(), OpName(u.op), Where(u.site).c_str());
          return false;
        }
        if (u.state == State::kCollective && (u.op != t.op || u.mask != t.mask || u.width != t.width)) {
          s.error = Format(
              "%s: mismatched warp collectives: %s is in %s (mask 0x%08x, width %d) at %s, but lane %u of "
              "its mask, %s, is in %s (mask 0x%08x, width %d) at %s",
              Prefix(s).c_str(), ThreadName(t).c_str(), OpName(t.op), t.mask, t.width, Where(t.site).c_str(), j,
              ThreadName(u).c_str(), OpName(u.op), u.mask, u.width, Where(u.site).c_str());
          return false;
        }
      }
      s.error = Format("%s: %s waits forever in %s (mask 0x%08x) at %s", Prefix(s).c_str(), ThreadName(t).c_str(),
                       OpName(t.op), t.mask, Where(t.site).c_str());
      return false;
    }
    if (t.state == State::kExited && !exited) exited = &t;
    if (t.state == State::kBarrier && !waiting) waiting = &t;
  }
  if (!waiting) return true;  // all exited
  if (exited) {
    unsigned n_exited = 0, n_waiting = 0;
    for (const Thread& t : s.threads) (t.state == State::kExited ? n_exited : n_waiting)++;
    s.error = Format(
        "%s: barrier divergence: %u threads exited while %u wait at %s (%s), e.g. %s exited and %s waits; "
        "every thread of the block must reach each __syncthreads (no early return before it)",
        Prefix(s).c_str(), n_exited, n_waiting, OpName(waiting->op), Where(waiting->site).c_str(),
        ThreadName(*exited).c_str(), ThreadName(*waiting).c_str());
    return false;
  }
  int count = 0;
  for (const Thread& t : s.threads) {
    if (t.op != waiting->op || !SameSite(t.site, waiting->site)) {
      s.error = Format(
          "%s: threads wait at different barriers: %s at %s (%s), %s at %s (%s); all threads of a block "
          "must meet at the same __syncthreads",
          Prefix(s).c_str(), ThreadName(*waiting).c_str(), OpName(waiting->op), Where(waiting->site).c_str(),
          ThreadName(t).c_str(), OpName(t.op), Where(t.site).c_str());
      return false;
    }
    count += t.predicate;
  }
  const int n = static_cast<int>(s.threads.size());
  for (Thread& t : s.threads) {
    switch (t.op) {
      case Op::kSyncThreadsCount:
        t.result = static_cast<uint64_t>(count);
        break;
      case Op::kSyncThreadsAnd:
        t.result = count == n;
        break;
      case Op::kSyncThreadsOr:
        t.result = count > 0;
        break;
      default:
        t.result = 0;
        break;
    }
    t.state = State::kRunnable;
  }
  ++s.barrier_generation;
  return false;
}

void FreeShared(Scheduler& s) {
  for (SharedAlloc& a : s.shared) std::free(a.ptr);
  s.shared.clear();
  std::free(s.dynamic_shared);
  s.dynamic_shared = nullptr;
  s.static_shared_bytes = 0;
}

// Shared arrays are 128-byte aligned (wmma needs 32 bytes; the GPU's shared window gives at least that).
constexpr size_t kSharedAlign = 128;

void* PoisonedAlloc(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kSharedAlign, bytes == 0 ? 1 : bytes) != 0 || !p) Fatal("out of memory for shared memory");
#if MS_SIM_TSAN
  // Not libc's memset: TSan intercepts it and would record this fiber's writes as racing with the others'.
  volatile unsigned char* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < bytes; ++i) b[i] = internal::kPoisonByte;
#else
  std::memset(p, internal::kPoisonByte, bytes);
#endif
  return p;
}

// Runs block `idx`. Returns false (with s.error set) on error.
bool RunBlock(Scheduler& s, uint3 idx) {
  blockIdx = idx;
  s.error.clear();
  s.barrier_generation = 0;
  s.dynamic_shared = PoisonedAlloc(s.info->dynamic_smem);
  const dim3 bd = s.info->block;
  for (unsigned i = 0; i < s.nthreads; ++i) {
    Thread& t = s.threads[i];
    t = Thread{};
    t.idx = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
    t.linear = i;
    t.warp = i / kWarp;
    t.lane = i % kWarp;
    t.stack = GetStack(s, i);
    InitFiber(t);
  }
#if MS_SIM_TSAN
  __tsan_release(&s.tsan_block_start);
#endif
  std::vector<unsigned> warp_order, lane_order;
  const unsigned nwarps = (s.nthreads + kWarp - 1) / kWarp;
  bool ok = true;
  for (;;) {
    MakeOrder(s, warp_order, nwarps);
    for (unsigned w : warp_order) {
      if (!RunWarp(s, w, lane_order)) {
        ok = false;
        break;
      }
    }
    if (!ok || ResolveBlock(s)) break;
    if (!s.error.empty()) {
      ok = false;
      break;
    }
  }
  if (!s.error.empty()) ok = false;
  ++s.stats.blocks;
  s.stats.threads += s.nthreads;
  if (!ok) {
    for (Thread& t : s.threads) {
      if (t.state != State::kExited) t.stack->dirty = true;  // abandoned mid-run
    }
#if MS_SIM_TSAN
    // Abandoned fibers never reached their exit's release: release on their behalf (a TSan context switch
    // only), so that freeing the arena and reusing the launcher's stack are ordered after their accesses.
    for (Thread& t : s.threads) {
      if (t.state == State::kExited) continue;
      __tsan_switch_to_fiber(t.stack->tsan_fiber, __tsan_switch_to_fiber_no_sync);
      __tsan_release(&s.tsan_block_end);
      __tsan_switch_to_fiber(s.main_tsan_fiber, __tsan_switch_to_fiber_no_sync);
    }
#endif
  }
#if MS_SIM_TSAN
  __tsan_acquire(&s.tsan_block_end);
#endif
  FreeShared(s);
  return ok;
}

bool CheckConfig(const LaunchInfo& info, const void* kernel, std::string* why, cudaError_t* code) {
  const dim3 b = info.block, g = info.grid;
  const unsigned long long threads = 1ull * b.x * b.y * b.z;
  *code = cudaErrorInvalidConfiguration;
  if (b.x == 0 || b.y == 0 || b.z == 0 || g.x == 0 || g.y == 0 || g.z == 0) {
    *why = Format("empty grid (%u,%u,%u) or block (%u,%u,%u)", g.x, g.y, g.z, b.x, b.y, b.z);
    return false;
  }
  if (threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64) {
    *why = Format("block (%u,%u,%u) has %llu threads; the limits are 1024 threads, x,y <= 1024, z <= 64", b.x, b.y, b.z,
                  threads);
    return false;
  }
  if (g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    *why = Format("grid (%u,%u,%u) exceeds the limits (2^31-1, 65535, 65535)", g.x, g.y, g.z);
    return false;
  }
  const size_t limit = internal::MaxDynamicSharedBytes(kernel);
  if (info.dynamic_smem > limit) {
    *code = cudaErrorInvalidValue;
    *why = Format(
        "%zu bytes of dynamic shared memory exceed the kernel's limit of %zu; above 48 KiB raise it first "
        "with cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)",
        info.dynamic_smem, limit);
    return false;
  }
  return true;
}

}  // namespace

const char* OpName(Op op) {
  switch (op) {
    case Op::kNone:
      return "nothing";
    case Op::kSyncThreads:
      return "__syncthreads";
    case Op::kSyncThreadsCount:
      return "__syncthreads_count";
    case Op::kSyncThreadsAnd:
      return "__syncthreads_and";
    case Op::kSyncThreadsOr:
      return "__syncthreads_or";
    case Op::kSyncWarp:
      return "__syncwarp";
    case Op::kShflIdx:
      return "__shfl_sync";
    case Op::kShflUp:
      return "__shfl_up_sync";
    case Op::kShflDown:
      return "__shfl_down_sync";
    case Op::kShflXor:
      return "__shfl_xor_sync";
    case Op::kBallot:
      return "__ballot_sync";
    case Op::kAny:
      return "__any_sync";
    case Op::kAll:
      return "__all_sync";
    case Op::kWmmaLoadA:
      return "wmma::load_matrix_sync (matrix_a)";
    case Op::kWmmaLoadB:
      return "wmma::load_matrix_sync (matrix_b)";
    case Op::kWmmaLoadC:
      return "wmma::load_matrix_sync (accumulator)";
    case Op::kWmmaStore:
      return "wmma::store_matrix_sync";
    case Op::kWmmaMma:
      return "wmma::mma_sync";
  }
  return "?";
}

void RunKernel(const LaunchInfo& info, const void* kernel_address, void (*invoke)(const void*), const void* args) {
  Scheduler& s = tls_sched;
  if (s.in_launch) Fatal("a kernel launched a kernel (dynamic parallelism is not emulated)");
  ++s.stats.launches;
  std::string why;
  cudaError_t code = cudaSuccess;
  if (!CheckConfig(info, kernel_address, &why, &code)) {
    internal::ReportError(
        Format("kernel %s launched at %s:%d: invalid launch: %s", info.kernel, info.file, info.line, why.c_str()));
    internal::SetLastError(code);
    return;
  }
#if MS_SIM_TSAN
  if (!s.main_tsan_fiber) s.main_tsan_fiber = __tsan_get_current_fiber();
#endif
  s.in_launch = true;
  s.info = &info;
  s.invoke = invoke;
  s.args = args;
  s.order = ReadOrder();
  const char* seed = std::getenv("MS_SIM_SEED");
  s.rng.seed(seed ? static_cast<unsigned>(std::strtoul(seed, nullptr, 10)) : 12345u);
  s.nthreads = info.block.x * info.block.y * info.block.z;
  s.threads.assign(s.nthreads, Thread{});
  blockDim = info.block;
  gridDim = info.grid;
  bool ok = true;
  for (unsigned z = 0; z < info.grid.z && ok; ++z) {
    for (unsigned y = 0; y < info.grid.y && ok; ++y) {
      for (unsigned x = 0; x < info.grid.x && ok; ++x) ok = RunBlock(s, uint3{x, y, z});
    }
  }
  s.in_launch = false;
  s.current = nullptr;
  if (!ok) {
    internal::ReportError(s.error);
    internal::SetLastError(cudaErrorLaunchFailure);
    return;
  }
  internal::SetLastError(cudaSuccess);
}

bool LaunchesAreQueued() {
  return internal::AsyncStreams() || internal::AnyCapture();  // a capture records the launches of its stream
}

void QueueKernel(const LaunchInfo& info, const void* kernel_address, void (*invoke)(const void*),
                 std::shared_ptr<const void> args) {
  const cudaError_t r = internal::Enqueue(info.stream, info.kernel, [info, kernel_address, invoke, args]() {
    RunKernel(info, kernel_address, invoke, args.get());
    return cudaGetLastError();  // this worker thread's: the outcome of the launch
  });
  if (r == cudaErrorInvalidResourceHandle) {
    internal::ReportError(
        Format("kernel %s launched at %s:%d: invalid launch: not a stream", info.kernel, info.file, info.line));
    internal::SetLastError(r);
    return;
  }
  // Run at once (sync mode while another stream captures) and failed, reported already; or its stream's capture was
  // invalidated.
  if (r != cudaSuccess) {
    internal::SetLastError(r);
    return;
  }
  internal::SetLastError(cudaSuccess);
}

void* SharedArray(Site site, size_t bytes) {
  Scheduler& s = tls_sched;
  [[maybe_unused]] Thread& t = CurrentThread("MS_SHARED_ARRAY");
  for (const SharedAlloc& a : s.shared) {
    if (a.bytes == bytes && SameSite(a.site, site) &&
        (a.site.function == site.function || std::strcmp(a.site.function, site.function) == 0)) {
#if MS_SIM_TSAN
      __tsan_acquire(&s.tsan_shared_alloc);
#endif
      return a.ptr;
    }
  }
  if (s.static_shared_bytes + bytes > internal::kDefaultSharedLimit) {
    Fault(site, "static shared memory would reach %zu bytes; the limit is 48 KiB (use dynamic shared memory)",
          s.static_shared_bytes + bytes);
  }
  if (s.static_shared_bytes + bytes + s.info->dynamic_smem > internal::kMaxSharedOptIn) {
    Fault(site, "static (%zu) + dynamic (%zu) shared memory exceed %zu bytes per block", s.static_shared_bytes + bytes,
          s.info->dynamic_smem, internal::kMaxSharedOptIn);
  }
  s.static_shared_bytes += bytes;
#if MS_SIM_TSAN
  // Allocate as the scheduler (a TSan context switch only; the stack stays), which publishes the poisoned
  // array to every fiber: the allocation is then ordered before all accesses, without ordering this fiber's
  // earlier accesses before the others' (which would hide races).
  __tsan_switch_to_fiber(s.main_tsan_fiber, __tsan_switch_to_fiber_no_sync);
  void* p = PoisonedAlloc(bytes);
  __tsan_release(&s.tsan_shared_alloc);
  __tsan_switch_to_fiber(t.stack->tsan_fiber, __tsan_switch_to_fiber_no_sync);
  __tsan_acquire(&s.tsan_shared_alloc);
#else
  void* p = PoisonedAlloc(bytes);
#endif
  s.shared.push_back(SharedAlloc{site, bytes, p});
  return p;
}

namespace {
// [p, p + bytes) lies inside the running block's dynamic shared memory or one of its shared arrays.
bool InShared(const Scheduler& s, const void* p, size_t bytes) {
  auto inside = [&](const void* base, size_t size) {
    const auto b = reinterpret_cast<uintptr_t>(base), a = reinterpret_cast<uintptr_t>(p);
    return base != nullptr && a >= b && a + bytes <= b + size;
  };
  if (inside(s.dynamic_shared, s.info->dynamic_smem)) return true;
  for (const SharedAlloc& a : s.shared) {
    if (inside(a.ptr, a.bytes)) return true;
  }
  return false;
}
}  // namespace

void AsyncCopy(Site site, void* dst, const void* src, size_t size_and_align, size_t zfill) {
  Scheduler& s = tls_sched;
  Thread& t = CurrentThread("__pipeline_memcpy_async");
  if (size_and_align != 4 && size_and_align != 8 && size_and_align != 16) {
    Fault(site, "__pipeline_memcpy_async: size_and_align %zu is not 4, 8 or 16", size_and_align);
  }
  if (zfill > size_and_align) {
    Fault(site, "__pipeline_memcpy_async: zfill %zu exceeds size_and_align %zu", zfill, size_and_align);
  }
  if (reinterpret_cast<uintptr_t>(dst) % size_and_align != 0 ||
      reinterpret_cast<uintptr_t>(src) % size_and_align != 0) {
    Fault(site, "__pipeline_memcpy_async: destination %p or source %p is not aligned to %zu bytes", dst, src,
          size_and_align);
  }
  if (!InShared(s, dst, size_and_align)) {
    Fault(site, "__pipeline_memcpy_async: destination %p (%zu bytes) is not in the block's shared memory", dst,
          size_and_align);
  }
  // The copy may land at any time until its group is waited for: the destination holds the poison from now (seen by
  // a read before the wait, and by TSan as this thread's write, racing with another thread's read that no barrier
  // orders before the issue), the data from the wait on.
  std::memset(dst, internal::kPoisonByte, size_and_align);
  t.copies.push_back(Thread::PendingCopy{dst, src, size_and_align - zfill, zfill, t.committed});
}

void LdmatrixRows(Site site, const void* p, unsigned ld) {
  Scheduler& s = tls_sched;
  CurrentThread("ldmatrix");
  constexpr size_t kRowBytes = 16 * 2;  // 16 bf16
  for (unsigned r = 0; r < 16; ++r) {
    const auto* row = static_cast<const char*>(p) + static_cast<size_t>(r) * ld * 2;
    if (reinterpret_cast<uintptr_t>(row) % 16 != 0) {
      Fault(site, "ldmatrix: row %u of the fragment at %p (leading dimension %u) is not 16-byte aligned", r, p, ld);
    }
    if (!InShared(s, row, kRowBytes)) {
      Fault(site, "ldmatrix: row %u of the fragment at %p (leading dimension %u) is not in the block's shared memory",
            r, p, ld);
    }
  }
}

void AsyncCommit(Site /*site*/) {
  ++CurrentThread("__pipeline_commit").committed;
}

void AsyncWaitPrior(Site /*site*/, size_t prior) {
  Thread& t = CurrentThread("__pipeline_wait_prior");
  // Every group but the newest `prior` committed ones is complete; the open group (not committed) is not waited for.
  const uint64_t done = t.committed > prior ? t.committed - prior : 0;
  size_t kept = 0;
  for (size_t i = 0; i < t.copies.size(); ++i) {
    const Thread::PendingCopy c = t.copies[i];
    if (c.group < done) {
      std::memcpy(c.dst, c.src, c.bytes);
      std::memset(static_cast<char*>(c.dst) + c.bytes, 0, c.zfill);
    } else {
      t.copies[kept++] = c;
    }
  }
  t.copies.resize(kept);
}

void* DynamicShared() {
  CurrentThread("MS_DYNAMIC_SHARED");
  return tls_sched.dynamic_shared;
}

int Barrier(Site site, Op op, int predicate) {
  Scheduler& s = tls_sched;
  Thread& t = CurrentThread(OpName(op));
  t.site = site;
  t.op = op;
  t.predicate = predicate;
  t.state = State::kBarrier;
#if MS_SIM_TSAN
  const unsigned gen = s.barrier_generation;
  __tsan_release(&s.tsan_barrier[gen & 1]);
#endif
  LeaveThread(s, t, false);
#if MS_SIM_TSAN
  __tsan_acquire(&s.tsan_barrier[gen & 1]);
#endif
  return static_cast<int>(t.result);
}

namespace {
// Waits at a warp collective (the caller has checked its arguments) and returns its result.
uint64_t Arrive(Scheduler& s, Thread& t, Site site, Op op, unsigned mask, uint64_t value, int arg, int width) {
  t.site = site;
  t.op = op;
  t.mask = mask;
  t.value = value;
  t.arg = arg;
  t.width = width;
  t.state = State::kCollective;
  ++t.collectives;
#if MS_SIM_TSAN
  const bool full = mask == 0xffffffffu;
  char* warp_slot = full ? &s.tsan_warp_sync[t.warp][++t.full_collectives & 1] : nullptr;
  __tsan_release(full ? warp_slot : &t.tsan_sync[t.collectives & 1]);
#endif
  LeaveThread(s, t, false);
#if MS_SIM_TSAN
  if (full) {
    __tsan_acquire(warp_slot);
  } else {
    for (unsigned i = 0; i < t.tsan_acquire_count; ++i) __tsan_acquire(t.tsan_acquire[i]);
  }
#endif
  return t.result;
}
}  // namespace

uint64_t WarpCollective(Site site, Op op, unsigned mask, uint64_t value, int arg, int width) {
  Scheduler& s = tls_sched;
  Thread& t = CurrentThread(OpName(op));
  if (!(mask >> t.lane & 1u)) {
    Fault(site, "%s with mask 0x%08x excludes the calling lane %u; the mask must name every lane that calls it",
          OpName(op), mask, t.lane);
  }
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    Fault(site, "%s with width %d: the width must be a power of two in [1, 32]", OpName(op), width);
  }
  return Arrive(s, t, site, op, mask, value, arg, width);
}

unsigned WmmaSync(Site site, Op op, const WmmaCall& call) {
  Scheduler& s = tls_sched;
  Thread& t = CurrentThread(OpName(op));
  const unsigned lanes = WarpLanes(s, t.warp);
  if (lanes != kWarp) {
    Fault(site, "%s in warp %u, which has %u threads: wmma needs all 32 lanes of a warp (launch whole warps)",
          OpName(op), t.warp, lanes);
  }
  if (op != Op::kWmmaMma) {
    const size_t bytes = WmmaTypeBytes(call.type);
    if (call.ldm * bytes % 16 != 0) {
      Fault(site, "%s with ldm %u: for %s elements ldm must be a multiple of %zu (16 bytes)", OpName(op), call.ldm,
            WmmaTypeName(call.type), 16 / bytes);
    }
    if (reinterpret_cast<uintptr_t>(call.mem) % 32 != 0) {
      Fault(site, "%s with pointer %p: the matrix pointer must be 256-bit (32-byte) aligned", OpName(op), call.mem);
    }
  }
  t.wmma = &call;
  t.wmma_error.clear();
  Arrive(s, t, site, op, 0xffffffffu, 0, 0, 32);
  t.wmma = nullptr;
  if (!t.wmma_error.empty()) Fault(site, "%s", t.wmma_error.c_str());
  return t.lane;
}

Stats GetStats() {
  return tls_sched.stats;
}

void ResetStats() {
  tls_sched.stats = Stats{};
  tls_sched.last_error_message.clear();
}

std::string LastErrorMessage() {
  return tls_sched.last_error_message;
}

namespace internal {
void ReportError(const std::string& message) {
  tls_sched.last_error_message = message;
  const char* quiet = std::getenv("MS_SIM_QUIET");
  if (!quiet || std::strcmp(quiet, "1") != 0) std::fprintf(stderr, "ms-sim: error: %s\n", message.c_str());
  const char* abort_env = std::getenv("MS_SIM_ABORT");
  if (abort_env && std::strcmp(abort_env, "1") == 0) std::abort();
}
}  // namespace internal

}  // namespace ms::sim
