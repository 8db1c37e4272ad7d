// Launchers of the test-only kernels in tests/kernels/semantics.cu (emulator and GPU alike) and
// tests/kernels/planted.cu (planted bugs: emulated builds only). Each returns the launch's CUDA error.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

namespace ms::kernels::testing {

// semantics.cu: results of the CUDA built-ins, checked against what the CUDA programming guide specifies.
// out (threads * 4): per thread __shfl_sync(src 3), __shfl_up_sync(2), __shfl_down_sync(5), __shfl_xor_sync(1)
// of the value 1000 + threadIdx.x, all with the given width; threads a multiple of 32.
cudaError_t Shuffles(int* out, int threads, int width);
// out (threads * 3): __ballot_sync(full, t % 3 == 0), __any_sync(full, t == 7), __all_sync(full, t < 1000),
// then (threads) a split warp: lanes 0-15 and 16-31 shuffle within their own half-masks.
cudaError_t Votes(unsigned* out, int threads);
cudaError_t HalfWarpShuffle(int* out, int threads);
// out (threads * 3): __syncthreads_count(t % 5 == 0), _and(t < threads), _or(t == threads - 1).
cudaError_t BarrierVotes(int* out, int threads);
// counters (5): atomicAdd(int) of 1, atomicMax(int) of t, atomicAdd(float) of 0.5, atomicCAS claim (the
// number of successful claims of a 0 -> 1 flag is 1), atomicAdd(unsigned long long) of t.
cudaError_t Atomics(int* counters, float* fsum, unsigned long long* usum, int blocks, int threads);
// out (grid * block elements): linear thread id of each thread of a 3-D grid of 3-D blocks, at its own
// global position.
cudaError_t Indexing(int* out, dim3 grid, dim3 block);
// Dynamic shared memory of `bytes` (> 48 KiB needs the attribute): each thread writes its slots, then sums
// the slots of the mirrored thread. out (threads).
cudaError_t DynamicShared(float* out, int threads, size_t bytes, bool raise_limit);
// Asynchronous copies into shared memory (__pipeline_memcpy_async of 16, 8 and 4 bytes, one with zfill, in two
// groups), read after __pipeline_wait_prior(1) by the copying thread and after (0) + a barrier by another:
// in (704 floats), out (960): see semantics.cu.
cudaError_t AsyncCopies(float* out, const float* in);

// planted.cu (emulator only): each kernel has the bug its name says.
cudaError_t PlantedEarlyReturn(float* out);          // return before __syncthreads in some threads
cudaError_t PlantedTwoBarriers(float* out);          // warps wait at different __syncthreads
cudaError_t PlantedMaskExcludesCaller(int* out);     // __shfl_sync mask without the caller
cudaError_t PlantedDeadlock(int* out);               // half a warp shuffles, the other half waits at a barrier
cudaError_t PlantedMismatchedCollectives(int* out);  // half a warp shuffles, the other half ballots
cudaError_t PlantedPartialWarpShuffle(int* out);     // 48 threads: full-mask shuffle reads nonexistent lanes
cudaError_t PlantedTooManyThreads(float* out);       // 1025 threads per block
cudaError_t PlantedTooMuchStaticShared(float* out);  // 52 KB of static shared memory
cudaError_t PlantedSharedOverflow(float* out);       // writes one element past a shared array (ASan)
cudaError_t PlantedMissingSync(float* out);          // reads shared memory written by other warps, no barrier (TSan)
cudaError_t PlantedWarpRace(float* out,
                            bool race);  // shared memory passed by warp collectives; race: one write after them (TSan)
cudaError_t PlantedHalfWarpMma(float* out);
// ldmatrix's demands on a fragment's rows (one warp, in: 256 bf16 in global memory): kind 0 meets them; 1 global
// memory, 2 and 3 misaligned rows, 4 a last row past the shared array.
cudaError_t PlantedLdmatrix(const __nv_bfloat16* in, int kind);
// Asynchronous copies (64 threads, in: 64 floats): kind 0 reads the copies after a barrier but without
// __pipeline_wait_prior (the emulator completes them only there: out reads the poison); 1 copies 16 bytes to a
// destination aligned to 4; 2 copies to global memory.
cudaError_t PlantedAsyncCopy(float* out, const float* in,
                             int kind);  // half a warp calls wmma::mma_sync, all call store_matrix_sync

// semantics.cu: one warp runs a single wmma m16n16k16 step,
//   d = scale_d * (op_a(A) * op_b(B) + C)
// with A, B (bf16) and C, D (float) 16x16 tiles staged in shared memory at the given leading dimensions
// (16..64, in elements) and memory layouts (row-major: element (r, c) at r * ld + c; col-major: at
// c * ld + r). Host buffers: a (16 * lda), b (16 * ldb), c and d (16 * ldc each); d's elements outside the
// tile are kept. fill_*: fill_fragment with fill_value instead of loading; scale_a: every a.x[i] *= scale_a
// after the load (an element-wise op on the fragment); a_offset: A's tile starts a_offset elements into
// its shared array, 0..16 (misaligned unless 0 or 16: for the emulator's checks only).
struct WmmaProbeArgs {
  bool a_col = false, b_col = false, c_col = false, d_col = false;
  int lda = 16, ldb = 16, ldc = 16;
  bool fill_a = false, fill_b = false, fill_c = false;
  float fill_value = 0.0f;
  float scale_a = 1.0f, scale_d = 1.0f;
  int a_offset = 0;
};
cudaError_t WmmaProbe(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c,
                      const WmmaProbeArgs& args, cudaStream_t stream);

}  // namespace ms::kernels::testing
