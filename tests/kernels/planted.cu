// Planted bugs, one per checker of the SIMT emulator (emulated builds only; tests/kernels/kernels_test.cpp
// checks each is reported). Line numbers appear in the expected messages: keep each bug on its own line.
#include "sim/simt.h"
#include "test_kernels.h"

namespace ms::kernels::testing {

constexpr unsigned kFull = 0xffffffffu;

__global__ void planted_early_return_kernel(float* out) {
  MS_SHARED_ARRAY(float, s, 64);
  if (threadIdx.x >= 40) return;  // BUG: threads 40..63 leave before the barrier
  s[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = s[(threadIdx.x + 1) % 40];
}

__global__ void planted_two_barriers_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();  // BUG: warp 0 waits here ...
  } else {
    __syncthreads();  // ... warp 1 here
  }
  out[threadIdx.x] = 1.0f;
}

__global__ void planted_mask_excludes_caller_kernel(int* out) {
  out[threadIdx.x] = __shfl_sync(0x0000ffffu, static_cast<int>(threadIdx.x), 0);  // BUG: lanes 16..31 call it
}

__global__ void planted_deadlock_kernel(int* out) {
  if (threadIdx.x % 32 < 16) out[threadIdx.x] = __shfl_sync(kFull, static_cast<int>(threadIdx.x), 0);  // BUG
  __syncthreads();
}

__global__ void planted_mismatched_kernel(int* out) {
  if (threadIdx.x < 16) {
    out[threadIdx.x] = __shfl_sync(kFull, static_cast<int>(threadIdx.x), 0);  // BUG: half shuffles ...
  } else {
    out[threadIdx.x] = static_cast<int>(__ballot_sync(kFull, 1));  // ... half ballots
  }
}

__global__ void planted_partial_warp_kernel(int* out) {
  out[threadIdx.x] = __shfl_down_sync(kFull, static_cast<int>(threadIdx.x), 16);  // BUG with 48 threads
}

__global__ void planted_static_shared_kernel(float* out) {
  MS_SHARED_ARRAY(float, big, 13000);  // BUG: 52,000 bytes > 48 KiB
  big[threadIdx.x] = 1.0f;
  out[threadIdx.x] = big[threadIdx.x];
}

__global__ void planted_shared_overflow_kernel(float* out) {
  MS_SHARED_ARRAY(float, s, 32);
  s[threadIdx.x] = 1.0f;  // BUG: launched with 33 threads
  __syncthreads();
  out[threadIdx.x] = s[threadIdx.x];
}

__global__ void planted_missing_sync_kernel(float* out) {
  MS_SHARED_ARRAY(float, s, 64);
  s[threadIdx.x] = static_cast<float>(threadIdx.x);
  // BUG: no __syncthreads() here
  out[threadIdx.x] = s[63 - threadIdx.x];
}

__global__ void planted_half_warp_mma_kernel(float* out) {
  namespace wmma = nvcuda::wmma;
  MS_SHARED_ARRAY(float, s, 256);
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> c;
  wmma::fill_fragment(a, __float2bfloat16(1.0f));
  wmma::fill_fragment(b, __float2bfloat16(1.0f));
  wmma::fill_fragment(c, 0.0f);
  if (threadIdx.x < 16) wmma::mma_sync(c, a, b, c);  // BUG: only half the warp runs the warp-wide mma
  wmma::store_matrix_sync(s, c, 16, wmma::mem_row_major);
  __syncwarp();
  out[threadIdx.x] = s[threadIdx.x];
}

// Shared memory passed between lanes through warp collectives only: what a lane wrote before a collective, every lane
// of it may read after it (ThreadSanitizer sees no race: the full-mask collective, then a partial-mask one in
// between, each order their lanes); with `race`, lane 0 writes after the last collective and lane 1 reads it, with
// nothing between them: a race whatever the schedule.
__global__ void planted_warp_race_kernel(float* out, bool race) {
  MS_SHARED_ARRAY(float, s, 32);
  const unsigned lane = threadIdx.x;
  s[lane] = static_cast<float>(lane);
  float v = __shfl_sync(0xffffffffu, s[lane], (lane + 1) % 32);  // = lane + 1 (mod 32)
  if (lane < 16) v += __shfl_xor_sync(0x0000ffffu, v, 1);
  v += s[(lane + 5) % 32];          // written by lane + 5 before the full-mask shuffle
  if (race && lane == 0) s[7] = v;  // BUG (race): no collective or barrier between this write and lane 1's read
  out[lane] = v + (lane == 1 ? s[7] : 0.0f);
}

cudaError_t PlantedEarlyReturn(float* out) {
  MS_LAUNCH(planted_early_return_kernel, 1, 64, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedTwoBarriers(float* out) {
  MS_LAUNCH(planted_two_barriers_kernel, 1, 64, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedMaskExcludesCaller(int* out) {
  MS_LAUNCH(planted_mask_excludes_caller_kernel, 1, 32, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedDeadlock(int* out) {
  MS_LAUNCH(planted_deadlock_kernel, 1, 64, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedMismatchedCollectives(int* out) {
  MS_LAUNCH(planted_mismatched_kernel, 1, 32, 0, 0, out);
  return cudaGetLastError();
}
__global__ void planted_async_copy_kernel(float* out, const float* in, int kind) {
  MS_SHARED_ARRAY(float, buf, 68);
  const int t = threadIdx.x;
  if (kind == 0) __pipeline_memcpy_async(buf + t, in + t, 4);  // BUG (kind 0): never waited for
  if (kind == 1) __pipeline_memcpy_async(buf + 1, in, 16);     // BUG (kind 1): the destination is 4-byte aligned
  if (kind == 2) __pipeline_memcpy_async(out + t, in + t, 4);  // BUG (kind 2): a global destination
  __pipeline_commit();
  __syncthreads();
  out[t] = buf[63 - t];
}

// What ldmatrix asks of a fragment's 16 rows (the tensor-core attention's LoadFrag checks it here before each load).
__global__ void planted_ldmatrix_kernel(const __nv_bfloat16* in, int kind) {
  MS_SHARED_ARRAY(__nv_bfloat16, tile, 16 * 24);
  if (kind == 0) ::ms::sim::LdmatrixRows(MS_SIM_SITE, tile, 24);       // fine: 16 rows of 48 bytes, aligned
  if (kind == 1) ::ms::sim::LdmatrixRows(MS_SIM_SITE, in, 16);         // BUG (kind 1): global memory
  if (kind == 2) ::ms::sim::LdmatrixRows(MS_SIM_SITE, tile + 4, 24);   // BUG (kind 2): rows 8-byte aligned
  if (kind == 3) ::ms::sim::LdmatrixRows(MS_SIM_SITE, tile, 25);       // BUG (kind 3): ld 25 misaligns row 1
  if (kind == 4) ::ms::sim::LdmatrixRows(MS_SIM_SITE, tile + 16, 24);  // BUG (kind 4): row 15 ends past the array
}

cudaError_t PlantedLdmatrix(const __nv_bfloat16* in, int kind) {
  MS_LAUNCH(planted_ldmatrix_kernel, 1, 32, 0, 0, in, kind);
  return cudaGetLastError();
}

cudaError_t PlantedAsyncCopy(float* out, const float* in, int kind) {
  MS_LAUNCH(planted_async_copy_kernel, 1, 64, 0, 0, out, in, kind);
  return cudaGetLastError();
}
cudaError_t PlantedPartialWarpShuffle(int* out) {
  MS_LAUNCH(planted_partial_warp_kernel, 1, 48, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedTooManyThreads(float* out) {
  MS_LAUNCH(planted_shared_overflow_kernel, 1, 1025, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedTooMuchStaticShared(float* out) {
  MS_LAUNCH(planted_static_shared_kernel, 1, 32, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedSharedOverflow(float* out) {
  MS_LAUNCH(planted_shared_overflow_kernel, 1, 33, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedMissingSync(float* out) {
  MS_LAUNCH(planted_missing_sync_kernel, 1, 64, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t PlantedWarpRace(float* out, bool race) {
  MS_LAUNCH(planted_warp_race_kernel, 1, 32, 0, 0, out, race);
  return cudaGetLastError();
}
cudaError_t PlantedHalfWarpMma(float* out) {
  MS_LAUNCH(planted_half_warp_mma_kernel, 1, 32, 0, 0, out);
  return cudaGetLastError();
}

}  // namespace ms::kernels::testing
