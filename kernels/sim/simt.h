// kernels/sim/simt.h: the one header every kernel source includes; it makes a .cu file compile twice.
//
//   nvcc:      the real CUDA headers (with <mma.h>, nvcuda::wmma) and a few macros, nothing else:
//                MS_LAUNCH(kernel, grid, block, smem, stream, args...) -> kernel<<<grid, block, smem, stream>>>(...)
//                MS_SHARED_ARRAY(T, name, n)          ->  __shared__ __align__(32) T name[n]
//                MS_SHARED_ARRAY2D(T, name, r, c)     ->  __shared__ __align__(32) T name[r][c]
//                MS_DYNAMIC_SHARED(T, name)           ->  extern __shared__ __align__(32) bytes, seen as T* name
//              (32-byte aligned: what wmma::load/store_matrix_sync require of a tile's first element)
//   g++/clang: a SIMT emulator (the "sim"), used by the kernel tests on machines without a GPU. Every CUDA
//              thread of a block is a fiber (its own mmap'd stack with a guard page) switched by a few lines
//              of x86-64 asm; the blocks of a grid run one after another on the launching OS thread; the
//              threads of a block are scheduled warp-major (each warp runs as far as it can, its warp
//              collectives resolved as they complete, then the next warp; then the block barrier
//              releases). The order is chosen by MS_SIM_SCHEDULE=fwd|rev|rand (MS_SIM_SEED for rand).
//
// What the sim checks, each reported with kernel name, launch site, block, thread and file:line (the launch
// fails with cudaErrorLaunchFailure, the message is printed on stderr and kept for ms::sim::LastErrorMessage()):
//   - barrier divergence: some threads exited while others wait at __syncthreads;
//   - threads waiting at different __syncthreads sites (or different variants: plain/_count/_and/_or);
//   - warp collectives (__shfl*_sync, __ballot/__any/__all_sync, __syncwarp): a mask that excludes the
//     caller, lanes of one mask at different collectives or with different masks/widths, and deadlock (a
//     lane named in the mask waits at __syncthreads, so the collective can never complete);
//   - wmma (nvcuda::wmma, below): every *_sync call is a collective of the full warp: a lane at another
//     collective or barrier (mismatch, deadlock), a lane that exited, lanes calling from different call
//     sites or with different pointers/ldm/layouts, a warp of fewer than 32 threads, an ldm that is not a
//     multiple of 16 bytes and a matrix pointer that is not 256-bit (32-byte) aligned are launch failures;
//   - launch limits: more than 1024 threads per block, block/grid dimension limits, dynamic shared memory
//     above 48 KiB unless raised with cudaFuncSetAttribute(MaxDynamicSharedMemorySize), static shared memory
//     above 48 KiB.
// And it makes hazards visible: a shuffle that reads an inactive, exited or nonexistent lane returns
// all-ones bits (NaN for floats, -1 for ints) and is counted (ms::sim::GetStats().poisoned_reads); shared
// memory comes only from the macros, each array a separate heap block (128-byte aligned) filled with 0xFF
// (NaN) and freed when its block ends, so AddressSanitizer sees overflows and reads-before-write show as NaN;
// cudaMalloc'd memory is filled with 0xFF too. Under AddressSanitizer every fiber switch is announced
// (__sanitizer_start/finish_switch_fiber); in the ThreadSanitizer variant (MS_KERNELS_TSAN, see
// docs/cuda.md) every CUDA thread is a TSan fiber, switched without synchronization, and only barriers
// and warp collectives create happens-before edges: a missing __syncthreads is then reported as a data
// race, whatever the schedule.
//
// Rules for kernel sources (scripts/lint_kernels.sh enforces the first three):
//   - shared memory only through the MS_SHARED_* / MS_DYNAMIC_SHARED macros (a bare __shared__ is a
//     compile error in the sim); no thread_local, no mutable static in device code;
//   - launches only through MS_LAUNCH; a kernel template is launched with its template arguments spelled
//     out and the template-id parenthesised: MS_LAUNCH((k<float, 4>), grid, block, 0, stream, ...);
//   - launch with whole warps when warp collectives use full masks (the sim poisons reads of
//     nonexistent lanes, as the GPU leaves them undefined);
//   - `#pragma unroll` is written MS_UNROLL (g++ warns on the unknown pragma).
//
// wmma (tensor cores through nvcuda::wmma) is emulated for the shape m16n16k16 with __nv_bfloat16 or __half
// A/B fragments (row_major or col_major) and float or __half accumulators (bf16 A/B need float): fragments
// hold num_elements values per lane in x[] as in CUDA, with the lane -> element mapping documented at
// ms::sim::WmmaRow/WmmaCol below (CUDA leaves it unspecified: code may only apply the same operation to
// every x[i]); load/store_matrix_sync rendezvous the warp, then each lane reads/writes its own elements
// (so ASan and TSan see those accesses as the kernel's); mma_sync accumulates in float, computed by the
// scheduler from all 32 lanes' fragments while the warp waits.
//
// Asynchronous copies (cp.async through the primitives of <cuda_pipeline_primitives.h>: __pipeline_memcpy_async,
// __pipeline_commit, __pipeline_wait_prior) may land at any time from their issue until their thread waits for their
// group, and the sim takes both ends: the issue fills the destination with the poison (NaN; TSan sees it as the
// issuing thread's write, so a buffer refilled while another thread may still read it is a race) and the data lands
// only at __pipeline_wait_prior, written then by the waiting thread (ordered for the others only by a later barrier);
// a barrier alone completes nothing, and copies never waited for are dropped. Reading the destination too early
// thus reads the poison.
// A size other than 4, 8 or 16, zfill above it, a misaligned source or destination, or a destination outside the
// block's shared memory fails the launch.
//
// Out of scope (not emulated; compile errors or undefined in the sim): mma PTX (mma.sync, ldmatrix),
// other wmma shapes or element types (tf32, int8, sub-byte), inline PTX, TMA / async barriers (mbarrier),
// thread-block clusters and distributed shared memory, grid sync and cooperative launches, dynamic
// parallelism, concurrent execution of streams by default (streams and events run eagerly, in order, so a
// missing stream/event synchronization is not caught; MS_SIM_STREAMS=async|deferred gives every stream a thread
// and, deferred, runs work only when something waits for it: runtime_hooks.h), concurrent blocks (blocks run one after
// another, so races between blocks and spin-waits on other threads are not emulated; TSan sees blocks ordered),
// bit-exact floating point (intrinsics use libm; compare with tolerances), performance (a switch costs ~60 ns: keep
// test shapes small), and non-x86-64 hosts.
//
// Thread safety: launches from different host threads are independent (per-thread scheduler, fiber pool
// and last error). Fibers never migrate between OS threads.
#pragma once

#if defined(__CUDACC__)  // ----------------------------------------------------------- nvcc: the real thing

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>
#include <mma.h>

#define MS_SIM_EMULATION 0
#define MS_LAUNCH(kernel, grid, block, smem, stream, ...) kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define MS_SHARED_ARRAY(type, name, count) __shared__ __align__(32) type name[count]
#define MS_SHARED_ARRAY2D(type, name, rows, cols) __shared__ __align__(32) type name[rows][cols]
#define MS_DYNAMIC_SHARED(type, name)                                       \
  extern __shared__ __align__(32) unsigned char ms_dynamic_shared_bytes_[]; \
  type* name = reinterpret_cast<type*>(ms_dynamic_shared_bytes_)
#define MS_UNROLL _Pragma("unroll")

#else  // ------------------------------------------------------------------------------ host: the emulator

#if !defined(__x86_64__)
#error "the SIMT emulator (kernels/sim) supports x86-64 hosts only"
#endif

// Standard headers first: the CUDA headers define attribute macros.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <source_location>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include <math.h>  // the C float functions (expf, tanhf, ...) in the global namespace, as in device code

// Execution-space attributes mean nothing on the host.
#undef __global__
#undef __device__
#undef __host__
#undef __shared__
#undef __launch_bounds__
#define __global__
#define __device__
#define __host__
#define __launch_bounds__(...)
// A bare __shared__ would silently become a per-thread local: make it an error that says what to do.
#define __shared__ ms_sim_bare_shared_is_not_supported_use_MS_SHARED_ARRAY_or_MS_DYNAMIC_SHARED

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#define MS_SIM_EMULATION 1
#define MS_UNROLL

namespace ms::sim {

// A source location: the kernel-side call site of a barrier, collective or shared declaration.
struct Site {
  const char* file;
  int line;
  const char* function = nullptr;  // __PRETTY_FUNCTION__ where it disambiguates (shared memory)
};
#define MS_SIM_SITE (::ms::sim::Site{__FILE__, __LINE__, nullptr})

// ---- launches ----

struct LaunchInfo {
  const char* kernel;  // the kernel expression as written at the launch
  const char* file;
  int line;
  dim3 grid;
  dim3 block;
  size_t dynamic_smem;
  cudaStream_t stream;
};

// Runs every block of the grid; `invoke(args)` runs the kernel body of one CUDA thread. Sets the thread's
// last CUDA error (cudaGetLastError) to the outcome.
void RunKernel(const LaunchInfo& info, const void* kernel_address, void (*invoke)(const void*), const void* args);

// Async stream modes (runtime_hooks.h): the launch is queued on its stream with its own copy of the arguments.
bool LaunchesAreQueued();
void QueueKernel(const LaunchInfo& info, const void* kernel_address, void (*invoke)(const void*),
                 std::shared_ptr<const void> args);

template <typename... P, typename... A>
void LaunchKernel(const LaunchInfo& info, void (*kernel)(P...), A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "MS_LAUNCH: wrong number of kernel arguments");
  // Arguments are converted to the parameter types once, as a launch does; every thread copies them.
  struct Pack {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  };
  auto invoke = [](const void* p) {
    const Pack* pk = static_cast<const Pack*>(p);
    std::apply(pk->kernel, pk->params);
  };
  if (LaunchesAreQueued()) {
    auto owned = std::make_shared<const Pack>(Pack{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)});
    QueueKernel(info, reinterpret_cast<const void*>(kernel), invoke, std::shared_ptr<const void>(owned, owned.get()));
    return;
  }
  const Pack pack{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)};
  RunKernel(info, reinterpret_cast<const void*>(kernel), invoke, &pack);
}

// ---- shared memory (per block, per declaration site) ----

void* SharedArray(Site site, size_t bytes);
void* DynamicShared();

// ---- barriers and warp collectives (resolved by the scheduler) ----

enum class Op : uint8_t {
  kNone,
  kSyncThreads,
  kSyncThreadsCount,
  kSyncThreadsAnd,
  kSyncThreadsOr,
  kSyncWarp,
  kShflIdx,
  kShflUp,
  kShflDown,
  kShflXor,
  kBallot,
  kAny,
  kAll,
  kWmmaLoadA,  // nvcuda::wmma collectives (always the full warp)
  kWmmaLoadB,
  kWmmaLoadC,
  kWmmaStore,
  kWmmaMma,
};
const char* OpName(Op op);

int Barrier(Site site, Op op, int predicate);
uint64_t WarpCollective(Site site, Op op, unsigned mask, uint64_t value, int arg, int width);

template <typename T>
T Shuffle(Site site, Op op, unsigned mask, T var, int arg, int width = 32) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of a type wider than 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = WarpCollective(site, op, mask, bits, arg, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// ---- asynchronous copies (cp.async: __pipeline_memcpy_async / _commit / _wait_prior) ----

void AsyncCopy(Site site, void* dst, const void* src, size_t size_and_align, size_t zfill = 0);
void AsyncCommit(Site site);
void AsyncWaitPrior(Site site, size_t prior);

// ---- ldmatrix's demands on a fragment's rows ----

// What ldmatrix.x4 asks of the 16 x 16 bf16 block it loads (the tensor-core attention's LoadFrag: ldmatrix on the
// GPU, wmma::load_matrix_sync here): each of its 16 rows of 32 bytes, ld elements apart, lies in the block's shared
// memory and starts 16-byte aligned. A fault names the row otherwise.
void LdmatrixRows(Site site, const void* p, unsigned ld);

// ---- introspection for tests ----

struct Stats {
  uint64_t launches = 0;
  uint64_t blocks = 0;
  uint64_t threads = 0;         // threads of those blocks
  uint64_t switches = 0;        // fiber switches into CUDA threads
  uint64_t poisoned_reads = 0;  // shuffles that read an inactive, exited or nonexistent lane
};
Stats GetStats();  // of the calling host thread
void ResetStats();
// The message of the last failed launch on this host thread ("" if none); cleared by ResetStats().
std::string LastErrorMessage();

}  // namespace ms::sim

// cuda_runtime.h declares its C++ conveniences only under nvcc; the one kernels need:
template <typename... P>
inline cudaError_t cudaFuncSetAttribute(void (*kernel)(P...), cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// ---- built-in variables: rewritten by the scheduler at every switch ----
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
inline constexpr int warpSize = 32;

// ---- launch and shared-memory macros ----
#define MS_LAUNCH(kernel, grid, block, smem, stream, ...)                                             \
  ::ms::sim::LaunchKernel(::ms::sim::LaunchInfo{#kernel, __FILE__, __LINE__, dim3(grid), dim3(block), \
                                                static_cast<size_t>(smem), (stream)},                 \
                          &kernel __VA_OPT__(, ) __VA_ARGS__)
#define MS_SHARED_ARRAY(type, name, count) \
  type* const name = static_cast<type*>(   \
      ::ms::sim::SharedArray(::ms::sim::Site{__FILE__, __LINE__, __PRETTY_FUNCTION__}, sizeof(type) * (count)))
#define MS_SHARED_ARRAY2D(type, name, rows, cols)                              \
  type(*const name)[cols] = static_cast<type(*)[cols]>(::ms::sim::SharedArray( \
      ::ms::sim::Site{__FILE__, __LINE__, __PRETTY_FUNCTION__}, sizeof(type) * (rows) * (cols)))
#define MS_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(::ms::sim::DynamicShared())

// ---- barriers ----
#define __syncthreads() ((void)::ms::sim::Barrier(MS_SIM_SITE, ::ms::sim::Op::kSyncThreads, 1))
#define __syncthreads_count(pred) ::ms::sim::Barrier(MS_SIM_SITE, ::ms::sim::Op::kSyncThreadsCount, (pred) ? 1 : 0)
#define __syncthreads_and(pred) ::ms::sim::Barrier(MS_SIM_SITE, ::ms::sim::Op::kSyncThreadsAnd, (pred) ? 1 : 0)
#define __syncthreads_or(pred) ::ms::sim::Barrier(MS_SIM_SITE, ::ms::sim::Op::kSyncThreadsOr, (pred) ? 1 : 0)
#define __threadfence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define __threadfence_block() __atomic_thread_fence(__ATOMIC_SEQ_CST)

// ---- warp collectives (width defaults to warpSize) ----
namespace ms::sim {
inline void SyncWarp(Site site, unsigned mask = 0xffffffffu) {
  WarpCollective(site, Op::kSyncWarp, mask, 0, 0, 32);
}
}  // namespace ms::sim
#define __syncwarp(...) ::ms::sim::SyncWarp(MS_SIM_SITE __VA_OPT__(, ) __VA_ARGS__)
#define __shfl_sync(...) ::ms::sim::Shuffle(MS_SIM_SITE, ::ms::sim::Op::kShflIdx, __VA_ARGS__)
#define __shfl_up_sync(...) ::ms::sim::Shuffle(MS_SIM_SITE, ::ms::sim::Op::kShflUp, __VA_ARGS__)
#define __shfl_down_sync(...) ::ms::sim::Shuffle(MS_SIM_SITE, ::ms::sim::Op::kShflDown, __VA_ARGS__)
#define __shfl_xor_sync(...) ::ms::sim::Shuffle(MS_SIM_SITE, ::ms::sim::Op::kShflXor, __VA_ARGS__)
#define __ballot_sync(mask, pred) \
  static_cast<unsigned>(::ms::sim::WarpCollective(MS_SIM_SITE, ::ms::sim::Op::kBallot, (mask), (pred) ? 1 : 0, 0, 32))
#define __any_sync(mask, pred) \
  static_cast<int>(::ms::sim::WarpCollective(MS_SIM_SITE, ::ms::sim::Op::kAny, (mask), (pred) ? 1 : 0, 0, 32))
#define __all_sync(mask, pred) \
  static_cast<int>(::ms::sim::WarpCollective(MS_SIM_SITE, ::ms::sim::Op::kAll, (mask), (pred) ? 1 : 0, 0, 32))
// ---- asynchronous copies: the primitives of <cuda_pipeline_primitives.h> ----
#define __pipeline_memcpy_async(...) ::ms::sim::AsyncCopy(MS_SIM_SITE, __VA_ARGS__)
#define __pipeline_commit() ::ms::sim::AsyncCommit(MS_SIM_SITE)
#define __pipeline_wait_prior(prior) ::ms::sim::AsyncWaitPrior(MS_SIM_SITE, (prior))

inline unsigned __activemask() {
  return 0xffffffffu;
}  // the sim cannot know; callers should not rely on it

// ---- wmma: nvcuda::wmma as warp collectives of the full warp ----
namespace ms::sim {

// Element types of the emulated fragments.
enum class WmmaType : uint8_t { kBf16, kHalf, kFloat };
template <typename T>
struct WmmaTypeOf;
template <>
struct WmmaTypeOf<__nv_bfloat16> {
  static constexpr WmmaType value = WmmaType::kBf16;
};
template <>
struct WmmaTypeOf<__half> {
  static constexpr WmmaType value = WmmaType::kHalf;
};
template <>
struct WmmaTypeOf<float> {
  static constexpr WmmaType value = WmmaType::kFloat;
};

// The lane -> element mapping of every emulated fragment (CUDA leaves it unspecified, so kernels may only
// apply the same operation to every x[i]): x[i] of lane l holds element (WmmaRow(l), WmmaCol(l, i)) =
// (l / 2, 8 * (l % 2) + i % 8) of the fragment's 16x16 matrix (matrix_a: m x k, matrix_b: k x n,
// accumulator: m x n; the same whatever the layout in memory). Fragments of 16 elements (half A/B, as
// in CUDA) hold each value twice, x[i + 8] == x[i] after a load or fill; mma_sync reads x[0..7].
constexpr int kWmmaDim = 16;
constexpr int kWmmaValuesPerLane = kWmmaDim * kWmmaDim / 32;
constexpr int WmmaRow(unsigned lane) {
  return static_cast<int>(lane / 2);
}
constexpr int WmmaCol(unsigned lane, int i) {
  return static_cast<int>(lane % 2) * 8 + i % kWmmaValuesPerLane;
}

// What a lane passes to a wmma collective (it lives in the lane's frame while the warp waits).
struct WmmaCall {
  const void* mem = nullptr;           // load/store: the matrix's first element
  unsigned ldm = 0;                    // load/store: leading dimension, in elements
  bool col_major = false;              // load/store: the layout in memory
  WmmaType type = WmmaType::kFloat;    // load/store: element type; mma_sync: of c
  WmmaType ab_type = WmmaType::kBf16;  // mma_sync: of a and b
  WmmaType d_type = WmmaType::kFloat;  // mma_sync: of d
  const void* a = nullptr;             // mma_sync: the lane's fragments (their x arrays)
  const void* b = nullptr;
  const void* c = nullptr;
  void* d = nullptr;
};
// The rendezvous of one wmma call: checks the call (a full warp; load/store: ldm a multiple of 16 bytes
// and a 32-byte aligned pointer), waits until all 32 lanes of the warp are at the same wmma call with the
// same arguments (anything else fails the launch), computes d for every lane when op is kWmmaMma, and
// returns the calling lane's index in its warp.
unsigned WmmaSync(Site site, Op op, const WmmaCall& call);

template <typename T>
void WmmaLoad(Site site, Op op, T* x, int n, const T* p, unsigned ldm, bool col_major) {
  WmmaCall call;
  call.mem = p;
  call.ldm = ldm;
  call.col_major = col_major;
  call.type = WmmaTypeOf<T>::value;
  const unsigned lane = WmmaSync(site, op, call);
  const size_t r = static_cast<size_t>(WmmaRow(lane));
  for (int i = 0; i < n; ++i) {  // the lane's own elements, read by the kernel's code (ASan/TSan see them)
    const size_t c = static_cast<size_t>(WmmaCol(lane, i));
    x[i] = p[col_major ? c * ldm + r : r * ldm + c];
  }
}

template <typename T>
void WmmaStore(Site site, T* p, const T* x, unsigned ldm, bool col_major) {
  WmmaCall call;
  call.mem = p;
  call.ldm = ldm;
  call.col_major = col_major;
  call.type = WmmaTypeOf<T>::value;
  const unsigned lane = WmmaSync(site, Op::kWmmaStore, call);
  const size_t r = static_cast<size_t>(WmmaRow(lane));
  for (int i = 0; i < kWmmaValuesPerLane; ++i) {
    const size_t c = static_cast<size_t>(WmmaCol(lane, i));
    p[col_major ? c * ldm + r : r * ldm + c] = x[i];
  }
}

inline Site CallerSite(const std::source_location& loc) {
  return Site{loc.file_name(), static_cast<int>(loc.line()), nullptr};
}

// The base of every emulated fragment: what CUDA's __frag_base provides.
template <typename T, int size>
struct alignas(8) WmmaFragment {
  enum { num_elements = size, num_storage_elements = size };
  using element_type = T;
  using storage_element_type = T;
  T x[size];
};

}  // namespace ms::sim

// The caller's file:line, for the wmma functions (which cannot be macros: kernels call them qualified).
#define MS_SIM_CALLER std::source_location::current()

namespace nvcuda::wmma {

struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int m, int n, int k, typename T, typename Layout = void>
class fragment;
template <>
class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, row_major> : public ::ms::sim::WmmaFragment<__nv_bfloat16, 8> {};
template <>
class fragment<matrix_a, 16, 16, 16, __nv_bfloat16, col_major> : public ::ms::sim::WmmaFragment<__nv_bfloat16, 8> {};
template <>
class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, row_major> : public ::ms::sim::WmmaFragment<__nv_bfloat16, 8> {};
template <>
class fragment<matrix_b, 16, 16, 16, __nv_bfloat16, col_major> : public ::ms::sim::WmmaFragment<__nv_bfloat16, 8> {};
template <>
class fragment<matrix_a, 16, 16, 16, __half, row_major> : public ::ms::sim::WmmaFragment<__half, 16> {};
template <>
class fragment<matrix_a, 16, 16, 16, __half, col_major> : public ::ms::sim::WmmaFragment<__half, 16> {};
template <>
class fragment<matrix_b, 16, 16, 16, __half, row_major> : public ::ms::sim::WmmaFragment<__half, 16> {};
template <>
class fragment<matrix_b, 16, 16, 16, __half, col_major> : public ::ms::sim::WmmaFragment<__half, 16> {};
template <>
class fragment<accumulator, 16, 16, 16, float> : public ::ms::sim::WmmaFragment<float, 8> {};
template <>
class fragment<accumulator, 16, 16, 16, __half> : public ::ms::sim::WmmaFragment<__half, 8> {};

// Not a collective (as in CUDA): each lane sets its own elements.
template <typename T, int size>
inline void fill_fragment(::ms::sim::WmmaFragment<T, size>& f, const std::type_identity_t<T>& v) {
  for (int i = 0; i < size; ++i) f.x[i] = v;
}

template <typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_a, 16, 16, 16, T, Layout>& f, const std::type_identity_t<T>* p,
                             unsigned ldm, std::source_location loc = MS_SIM_CALLER) {
  ::ms::sim::WmmaLoad(::ms::sim::CallerSite(loc), ::ms::sim::Op::kWmmaLoadA, f.x, f.num_elements, p, ldm,
                      std::is_same_v<Layout, col_major>);
}
template <typename T, typename Layout>
inline void load_matrix_sync(fragment<matrix_b, 16, 16, 16, T, Layout>& f, const std::type_identity_t<T>* p,
                             unsigned ldm, std::source_location loc = MS_SIM_CALLER) {
  ::ms::sim::WmmaLoad(::ms::sim::CallerSite(loc), ::ms::sim::Op::kWmmaLoadB, f.x, f.num_elements, p, ldm,
                      std::is_same_v<Layout, col_major>);
}
template <typename T>
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T>& f, const std::type_identity_t<T>* p, unsigned ldm,
                             layout_t layout, std::source_location loc = MS_SIM_CALLER) {
  ::ms::sim::WmmaLoad(::ms::sim::CallerSite(loc), ::ms::sim::Op::kWmmaLoadC, f.x, f.num_elements, p, ldm,
                      layout == mem_col_major);
}
template <typename T>
inline void store_matrix_sync(std::type_identity_t<T>* p, const fragment<accumulator, 16, 16, 16, T>& f, unsigned ldm,
                              layout_t layout, std::source_location loc = MS_SIM_CALLER) {
  ::ms::sim::WmmaStore(::ms::sim::CallerSite(loc), p, f.x, ldm, layout == mem_col_major);
}

// d = a * b + c (d may be c), accumulated in float.
template <typename TD, typename TAB, typename LA, typename LB, typename TC>
inline void mma_sync(fragment<accumulator, 16, 16, 16, TD>& d, const fragment<matrix_a, 16, 16, 16, TAB, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, TAB, LB>& b, const fragment<accumulator, 16, 16, 16, TC>& c,
                     std::source_location loc = MS_SIM_CALLER) {
  static_assert(!std::is_same_v<TAB, __nv_bfloat16> || (std::is_same_v<TC, float> && std::is_same_v<TD, float>),
                "wmma::mma_sync: __nv_bfloat16 A/B need float accumulators (as in CUDA)");
  ::ms::sim::WmmaCall call;
  call.type = ::ms::sim::WmmaTypeOf<TC>::value;
  call.ab_type = ::ms::sim::WmmaTypeOf<TAB>::value;
  call.d_type = ::ms::sim::WmmaTypeOf<TD>::value;
  call.a = a.x;
  call.b = b.x;
  call.c = c.x;
  call.d = d.x;
  ::ms::sim::WmmaSync(::ms::sim::CallerSite(loc), ::ms::sim::Op::kWmmaMma, call);
}

}  // namespace nvcuda::wmma

// ---- atomics: __atomic builtins, so ThreadSanitizer sees atomic accesses, not races ----
namespace ms::sim {
template <typename T, typename F>
T AtomicUpdate(T* address, F f) {  // CAS loop: returns the old value
  T old;
  __atomic_load(address, &old, __ATOMIC_RELAXED);
  T desired;
  do {
    desired = f(old);
  } while (!__atomic_compare_exchange(address, &old, &desired, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  return old;
}
}  // namespace ms::sim

#define MS_SIM_INT_ATOMICS(T)                                                               \
  inline T atomicAdd(T* a, T v) {                                                           \
    return __atomic_fetch_add(a, v, __ATOMIC_RELAXED);                                      \
  }                                                                                         \
  inline T atomicSub(T* a, T v) {                                                           \
    return __atomic_fetch_sub(a, v, __ATOMIC_RELAXED);                                      \
  }                                                                                         \
  inline T atomicAnd(T* a, T v) {                                                           \
    return __atomic_fetch_and(a, v, __ATOMIC_RELAXED);                                      \
  }                                                                                         \
  inline T atomicOr(T* a, T v) {                                                            \
    return __atomic_fetch_or(a, v, __ATOMIC_RELAXED);                                       \
  }                                                                                         \
  inline T atomicXor(T* a, T v) {                                                           \
    return __atomic_fetch_xor(a, v, __ATOMIC_RELAXED);                                      \
  }                                                                                         \
  inline T atomicExch(T* a, T v) {                                                          \
    return __atomic_exchange_n(a, v, __ATOMIC_RELAXED);                                     \
  }                                                                                         \
  inline T atomicMax(T* a, T v) {                                                           \
    return ::ms::sim::AtomicUpdate(a, [v](T o) { return o > v ? o : v; });                  \
  }                                                                                         \
  inline T atomicMin(T* a, T v) {                                                           \
    return ::ms::sim::AtomicUpdate(a, [v](T o) { return o < v ? o : v; });                  \
  }                                                                                         \
  inline T atomicCAS(T* a, T compare, T v) {                                                \
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED); \
    return compare;                                                                         \
  }
MS_SIM_INT_ATOMICS(int)
MS_SIM_INT_ATOMICS(unsigned)
MS_SIM_INT_ATOMICS(unsigned long long)
MS_SIM_INT_ATOMICS(long long)
#undef MS_SIM_INT_ATOMICS
inline float atomicAdd(float* a, float v) {
  return ::ms::sim::AtomicUpdate(a, [v](float o) { return o + v; });
}
inline double atomicAdd(double* a, double v) {
  return ::ms::sim::AtomicUpdate(a, [v](double o) { return o + v; });
}
inline float atomicExch(float* a, float v) {
  float old;
  __atomic_exchange(a, &v, &old, __ATOMIC_RELAXED);
  return old;
}
inline unsigned atomicInc(unsigned* a, unsigned limit) {
  return ::ms::sim::AtomicUpdate(a, [limit](unsigned o) { return o >= limit ? 0u : o + 1; });
}

// ---- math and bit intrinsics (device-only in the CUDA headers); libm precision, not the GPU's ----
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline double rsqrt(double x) {
  return 1.0 / std::sqrt(x);
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float __log2f(float x) {
  return std::log2(x);
}
inline float __sinf(float x) {
  return std::sin(x);
}
inline float __cosf(float x) {
  return std::cos(x);
}
inline float __tanhf(float x) {
  return std::tanh(x);
}
inline float __powf(float x, float y) {
  return std::pow(x, y);
}
inline float __fdividef(float a, float b) {
  return a / b;
}
inline float __frcp_rn(float x) {
  return 1.0f / x;
}
inline float __fsqrt_rn(float x) {
  return std::sqrt(x);
}
inline float __fmaf_rn(float a, float b, float c) {
  return std::fma(a, b, c);
}
inline float __fadd_rn(float a, float b) {
  return a + b;
}
inline float __fmul_rn(float a, float b) {
  return a * b;
}
inline float __saturatef(float x) {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}
inline float __int_as_float(int x) {
  return std::bit_cast<float>(x);
}
inline int __float_as_int(float x) {
  return std::bit_cast<int>(x);
}
inline float __uint_as_float(unsigned x) {
  return std::bit_cast<float>(x);
}
inline unsigned __float_as_uint(float x) {
  return std::bit_cast<unsigned>(x);
}
inline double __longlong_as_double(long long x) {
  return std::bit_cast<double>(x);
}
inline long long __double_as_longlong(double x) {
  return std::bit_cast<long long>(x);
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline unsigned __brev(unsigned x) {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) {  // the high 32 bits of the 64-bit product
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
template <typename T>
inline T __ldg(const T* p) {
  return *p;
}
template <typename T>
inline T __ldca(const T* p) {  // ld.global.ca: a global load cached in L1 as usual (not the read-only path)
  return *p;
}
#define MS_SIM_MINMAX(T)   \
  inline T min(T a, T b) { \
    return b < a ? b : a;  \
  }                        \
  inline T max(T a, T b) { \
    return a < b ? b : a;  \
  }
MS_SIM_MINMAX(int)
MS_SIM_MINMAX(unsigned)
MS_SIM_MINMAX(long)
MS_SIM_MINMAX(unsigned long)
MS_SIM_MINMAX(long long)
MS_SIM_MINMAX(unsigned long long)
#undef MS_SIM_MINMAX
inline float min(float a, float b) {
  return fminf(a, b);
}
inline float max(float a, float b) {
  return fmaxf(a, b);
}
inline double min(double a, double b) {
  return fmin(a, b);
}
inline double max(double a, double b) {
  return fmax(a, b);
}

#endif  // __CUDACC__
