// The CUDA backend: a Device on the CUDA runtime (streams, events, a caching allocator) and an ops::Backend
// whose ops are the fused kernels of kernels/ plus cuBLAS GEMMs (bf16 inputs, fp32 accumulation).
//
// The same sources build two libraries (docs/cuda.md):
//   ms_cuda_gpu  with nvcc: linked against libcudart, cuBLAS and the nvcc-compiled kernels (the `megascale`
//                binary). Without nvcc it is a library whose factories return Unavailable.
//   ms_cuda_sim  with only the CUDA headers: the kernels run on the SIMT emulator (kernels/sim), the runtime
//                and cuBLAS calls on its CPU implementation (the `megascale-emu` binary and the tests).
// Which one a program has is fixed when it is linked; Flavor() tells.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/core.h"
#include "device/device.h"
#include "ops/ops.h"

typedef struct CUstream_st* cudaStream_t;  // as cuda_runtime_api.h declares it

namespace ms::cuda {

enum class Flavor { kNone, kGpu, kEmulated };
Flavor LinkedFlavor();
// "none", "gpu", "emulated".
inline const char* FlavorName(Flavor f) {
  switch (f) {
    case Flavor::kGpu:
      return "gpu";
    case Flavor::kEmulated:
      return "emulated";
    default:
      return "none";
  }
}

// Caching allocator statistics of a CUDA device.
struct AllocatorStats {
  size_t bytes_in_use = 0;  // handed out to callers
  size_t bytes_cached = 0;  // held in the free lists (cudaMalloc'd, not handed out)
  size_t peak_in_use = 0;
  int64_t cuda_mallocs = 0;  // calls of cudaMalloc made (misses)
  int64_t cache_hits = 0;    // allocations served from the free lists
};

// A Device on CUDA device `ordinal` (cudaSetDevice). Memory comes from a caching allocator: blocks are
// rounded up (512 B under 1 MiB, 2 MiB granules above), kept in size-ordered free lists on Free and reused;
// on cudaMalloc failure the cache is released and the allocation retried once; the error names the size,
// the bytes in use and cached. Streams are non-blocking cudaStreams; Stream::Enqueue runs a host function on
// the stream (cudaLaunchHostFunc); events are cudaEvents (timing disabled).
// Errors: no CUDA device, a bad ordinal, or a runtime without a driver give Unavailable naming the cause.
Result<std::unique_ptr<device::Device>> MakeCudaDevice(int ordinal);
// The native stream of a Stream created by a CUDA device (nullptr for streams of other devices).
cudaStream_t NativeStream(device::Stream& stream);
// Allocator statistics of a device made by MakeCudaDevice (zeros for other devices).
AllocatorStats GetAllocatorStats(device::Device& device);
// Returns every cached block to cudaFree (blocks in use stay).
void ReleaseCachedMemory(device::Device& device);

// How bf16 GEMMs get their bf16 operands (config runtime.bf16_operands): kKeep, cast kernels (CastFloatToBf16)
// round the fp32 operands and cuBLAS multiplies bf16, and the backend takes roundings the caller keeps
// (keeps_bf16_copies(), ops::Bf16Copies: the model's weights once per step — by the optimizer's update, AdamWTensor::
// p16, or a cast —, layer inputs once per micro-batch);
// kCast, the same casts into workspaces at every GEMM, nothing kept (least memory); kCublas, cuBLAS takes the
// fp32 operands and converts them itself (CUBLAS_COMPUTE_32F_FAST_16BF): no cast kernels, no bf16 workspaces.
// All three give the same bits under the emulator.
enum class Bf16Operands { kKeep, kCast, kCublas };

// The ops backend on `device` (made by MakeCudaDevice; not owned): every op enqueued on one stream of the
// device, GEMMs by cuBLAS (cublasGemmEx; with bf16_gemm the operands are rounded to bf16 as `operands` says and
// multiplied with fp32 accumulation into fp32 outputs, else fp32 throughout), everything else by the kernels
// of kernels/. Parameters, gradients and optimizer state stay fp32 (the masters).
// attention_ds_max_bytes (runtime.attention_stored_ds: kAttentionDsMaxBytes, or 0 when false): the tensor-core
// attention backward keeps dS between its two kernels in a workspace where its tiles take at most this many bytes
// (kernels/attention.h, AttentionDsTileBytes: GPT-2 small at 16 x 1024 tokens, 209 MiB), so its dQ kernel makes one
// product per tile pair instead of three and the softmax again; above it (long sequences: the tiles grow as T^2 / 2
// without a window) it forms dS again, with no workspace.
constexpr int64_t kAttentionDsMaxBytes = int64_t{1} << 30;
Result<std::unique_ptr<ops::Backend>> MakeCudaBackend(device::Device* device, bool bf16_gemm = true,
                                                      Bf16Operands operands = Bf16Operands::kKeep,
                                                      int64_t attention_ds_max_bytes = kAttentionDsMaxBytes);
// The cudaStream_t a backend made by MakeCudaBackend enqueues on (as void*, so that callers need no CUDA
// headers); nullptr for other backends. Communicators order their work after it (comm::NcclOptions).
void* BackendStream(ops::Backend& backend);
// The GEMMs with a GeLU epilogue a backend made by MakeCudaBackend has run (MatmulForward with Bf16Copies::gelu16,
// MatmulBackward with dgelu_aux16): by cuBLASLt's GELU_AUX_BIAS / DGELU epilogues, and by the fallback (the GEMM, then
// the bias + GeLU kernel) where cuBLASLt offered no algorithm for the problem; bias_*: the same for the GEMMs with
// only their bias in the epilogue (MatmulForward with Bf16Copies::out16 and the bias: the qkv GEMM; the fallback's
// kernel: the bf16 AddRowBias). Zeros for other backends.
// The workspace a CUDA backend gives cuBLASLt (allocated at the first epilogue GEMM): NVIDIA's recommendation for
// Hopper.
constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;
struct EpilogueStats {
  int64_t cublaslt = 0;
  int64_t fallback = 0;
  int64_t bias_cublaslt = 0;
  int64_t bias_fallback = 0;
};
EpilogueStats GetEpilogueStats(ops::Backend& backend);
// The tensor-core attention backwards a backend made by MakeCudaBackend has run: with dS kept between the kernels
// (5 products), and forming it again (7: runtime.attention_stored_ds false, or tiles above attention_ds_max_bytes).
// Zeros for other backends.
// cudnn_*: the attention forwards and backwards cuDNN ran (runtime.attention_kernels: cudnn), and the calls that fell
// back to megascale's kernels, with the first fallback's reason.
struct AttentionStats {
  int64_t stored_ds = 0;
  int64_t recompute = 0;
  int64_t cudnn_forward = 0;
  int64_t cudnn_backward = 0;
  int64_t cudnn_fallback = 0;
  int64_t cudnn_disagreed = 0;  // checks (below) that found cuDNN's result wrong: cuDNN left off after the first
  int64_t split_dkdv = 0;       // tensor-core backwards by the split dK/dV kernel (runtime.attention_split_dkdv)
  std::string cudnn_note;
  // runtime.attention_autotune: the keys (pass and shape) tuned, the candidates left out for differing from the
  // default's bits, and per key the choice with every candidate's time.
  int64_t autotuned = 0;
  int64_t autotune_disagreed = 0;
  std::vector<std::string> autotune_notes;
};
AttentionStats GetAttentionStats(ops::Backend& backend);
// runtime.attention_split_dkdv: the tensor-core attention backward's dK/dV kernel with FlashAttention-2's split — 8
// warps to a block of 64 keys, each with half of D (kernels/attention.h, SetAttentionTcSplitDkDv) — where it applies
// (bf16 attention inputs with 16-byte aligned rows, D a multiple of 32, the register softmax); the same bits as the
// default 4-warp kernel. InvalidArgument for a backend that is not a CUDA one.
Status UseSplitDkDvAttention(ops::Backend& backend, bool on);
// runtime.attention_autotune: at the first call of each pass and shape, megascale's tensor-core attention runs every
// variant of its kernels that gives the default's bits (the wide forward, the split dK/dV kernel — at D <= 64 —, the
// run-time product bounds) on the call's inputs, leaves out any whose outputs differ from the default's bit for bit
// (logged as a kernel bug), and runs that call and the later ones of the shape with the fastest (lib/cuda/
// attention_tune.h). The choice changes no result. InvalidArgument for a backend that is not a CUDA one.
Status UseAttentionAutotune(ops::Backend& backend, bool on);
// runtime.attention_kernels: cudnn — the bf16 training path's attention, forward and backward, through cuDNN's fused
// attention (lib/cuda/cudnn_sdpa.h; libcudnn.so.9 loaded at the first call); where cuDNN does not take a call or
// fails, megascale's kernel runs and GetAttentionStats counts it. Unimplemented in a build without
// cuDNN support (the emulated flavor, or no cudnn.h at build time); InvalidArgument for a backend that is not a CUDA
// one or has fp32 GEMMs.
Status UseCudnnAttention(ops::Backend& backend);
// The first call of each pass and shape that cuDNN runs is checked against megascale's kernels on the same inputs
// (their result computed too, read back with the stream synchronized: once per shape). cuDNN agrees when
// max |cuDNN - megascale| <= rtol * max |megascale| + 1e-6 for each output (out, lse; dqkv). Where it does not,
// megascale's result replaces cuDNN's, cuDNN is left off for the rest of the backend's life, the disagreement is
// logged and counted (AttentionStats::cudnn_disagreed, cudnn_note). Process-wide; rtol 0.05 by default (bf16
// roundings in other orders differ by ~1 %). A negative rtol makes every check disagree (tests).
void SetCudnnCheckTolerance(double rtol);
double CudnnCheckTolerance();
// Tests: before every cuDNN attention call, fill its workspace and row-term scratch — and 1 MiB past each — with
// `byte` (negative: off, the default), so that a result depending on memory cuDNN did not write differs between two
// fills. (On an H200 at 2829a9d, whose backward graph was wrong, a pattern there showed up in dqkv.)
void SetCudnnScratchFill(int byte);
int CudnnScratchFill();
// Tests (diagnosis on a GPU): the form of cuDNN's attention backward graph for the plans built after the call,
// process-wide; each -1 (what cudnn-frontend does for the loaded release: the default), 0 (off) or 1 (on).
// deterministic: dQ written straight from dS K (the frontend's deterministic form) instead of accumulated in fp32;
// padding_mask: the padding-mask workaround the frontend applies for cuDNN <= 9.15 at T % 128 != 0. No effect in a
// build without cuDNN support.
void SetCudnnBackwardForm(int deterministic, int padding_mask);

// ---- NCCL communicators (lib/cuda/nccl_comm.cpp) ----------------------------------------------------------------
//
// The flavor's NCCL: libnccl in the GPU flavor (when NCCL was found), the emulated NCCL of kernels/sim/nccl.cpp in
// the emulated one (NCCL's stream semantics on the emulated device: docs/cuda.md). Each communicator owns one
// non-blocking stream. A call makes that stream wait for an event recorded on `compute_stream` (so it sees what
// the compute produced, without a host synchronization), enqueues the NCCL operation, records a completion event
// and returns a Work. Collectives and sends/receives run in issue order on the stream; a receive blocks it until
// the matching send arrives, so sends and receives that must progress together go through GroupP2p
// (ncclGroupStart/End). Work::Wait polls the event and ncclCommGetAsyncError: the watchdog. An operation that
// makes no progress for `timeout`, or an asynchronous NCCL error, aborts the communicator (ncclCommAbort: every
// later call fails at once) and returns Timeout/Unavailable naming the group, the operation with its sequence
// number and size, and the peer (point to point) or the group's other ranks (collectives).
struct NcclOptions {
  std::string name = "nccl";                  // shown in every message, e.g. "nccl-pp[0]"
  void* compute_stream = nullptr;             // the cudaStream_t producing and consuming the buffers (BackendStream)
  std::chrono::milliseconds timeout{60'000};  // runtime.collective_timeout_s
  device::Device* device = nullptr;           // a CUDA device whose caching allocator must know the stream (Free of
                                              // a block is then ordered after the communicator's work too)
};
// Whether this flavor has an NCCL (false: GPU flavor built without NCCL, or no CUDA at all).
bool NcclAvailable();
// The id the group's rank 0 makes and every member passes to MakeNcclCommunicator (bytes, for a store).
Result<std::string> NewNcclUniqueId();
// ncclCommInitRank from `id`, then the communicator. Blocks until every member has joined.
Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(const std::string& id, int rank, int size,
                                                                 NcclOptions options);
// The caching allocator of `device` (made by MakeCudaDevice) also orders its reuse of freed blocks after work
// enqueued on `stream` (a communicator's). Call the returned function before the stream is destroyed (it may
// outlive the device). No-op for other devices.
std::function<void()> RegisterExternalStream(device::Device& device, cudaStream_t stream);

}  // namespace ms::cuda
