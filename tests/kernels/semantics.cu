// Test kernels that pin down the semantics of CUDA built-ins (shuffles with widths, votes, block barriers
// with predicates, atomics, 3-D indexing, dynamic shared memory). and of the wmma API (WmmaProbe). Compiled for the
// emulator and by nvcc for the GPU tests, with the same expected values: on a GPU they check that the emulator agrees
// with hardware.
#include <type_traits>

#include "sim/simt.h"
#include "test_kernels.h"

namespace ms::kernels::testing {

constexpr unsigned kFull = 0xffffffffu;

__global__ void shuffles_kernel(int* out, int width) {
  const int t = threadIdx.x;
  const int v = 1000 + t;
  out[4 * t + 0] = __shfl_sync(kFull, v, 3, width);
  out[4 * t + 1] = __shfl_up_sync(kFull, v, 2, width);
  out[4 * t + 2] = __shfl_down_sync(kFull, v, 5, width);
  out[4 * t + 3] = __shfl_xor_sync(kFull, v, 1, width);
}

__global__ void votes_kernel(unsigned* out) {
  const int t = threadIdx.x;
  out[3 * t + 0] = __ballot_sync(kFull, t % 3 == 0);
  out[3 * t + 1] = __any_sync(kFull, t == 7);
  out[3 * t + 2] = __all_sync(kFull, t < 1000);
}

__global__ void half_warp_shuffle_kernel(int* out) {
  const int t = threadIdx.x;
  const int lane = t % 32;
  if (lane < 16) {
    out[t] = __shfl_sync(0x0000ffffu, t, 15);
  } else {
    out[t] = __shfl_sync(0xffff0000u, t, 16) + __shfl_down_sync(0xffff0000u, 1, 1, 16);
  }
}

__global__ void barrier_votes_kernel(int* out) {
  const int t = threadIdx.x;
  const int n = blockDim.x;
  out[3 * t + 0] = __syncthreads_count(t % 5 == 0);
  out[3 * t + 1] = __syncthreads_and(t < n);
  out[3 * t + 2] = __syncthreads_or(t == n - 1);
}

__global__ void atomics_kernel(int* counters, float* fsum, unsigned long long* usum) {
  const int t = threadIdx.x;
  atomicAdd(&counters[0], 1);
  atomicMax(&counters[1], t);
  atomicAdd(fsum, 0.5f);
  if (atomicCAS(&counters[2], 0, 1) == 0) atomicAdd(&counters[3], 1);
  atomicAdd(usum, static_cast<unsigned long long>(t));
}

__global__ void indexing_kernel(int* out) {
  const unsigned bx = blockIdx.x, by = blockIdx.y, bz = blockIdx.z;
  const unsigned block_linear = (bz * gridDim.y + by) * gridDim.x + bx;
  const unsigned thread_linear = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const unsigned per_block = blockDim.x * blockDim.y * blockDim.z;
  out[block_linear * per_block + thread_linear] = static_cast<int>(block_linear * per_block + thread_linear);
}

__global__ void dynamic_shared_kernel(float* out, int slots_per_thread) {
  MS_DYNAMIC_SHARED(float, buf);
  const int t = threadIdx.x, n = blockDim.x;
  for (int k = 0; k < slots_per_thread; ++k) buf[t * slots_per_thread + k] = static_cast<float>(t + k);
  __syncthreads();
  const int m = n - 1 - t;
  float sum = 0.0f;
  for (int k = 0; k < slots_per_thread; ++k) sum += buf[m * slots_per_thread + k];
  out[t] = sum;
}

// Asynchronous copies (cp.async), 64 threads: group 0 a 16-byte copy of in[4 t ..]; group 1 an 8-byte copy of
// in[256 + 2 t ..] and a 16-byte copy of in[384 + 4 t ..] with zfill 8 (its last two floats zero) and a 4-byte copy of
// in[640 + t]. After __pipeline_wait_prior(1) the thread reads its own group-0 floats (out[4 t ..]); after
// __pipeline_wait_prior(0) and a barrier, those of the mirrored thread 63 - t (out[256 + ...]).
__global__ void async_copy_kernel(float* out, const float* in) {
  MS_SHARED_ARRAY(float, buf, 704);
  const int t = threadIdx.x, m = 63 - t;
  __pipeline_memcpy_async(buf + 4 * t, in + 4 * t, 16);
  __pipeline_commit();
  __pipeline_memcpy_async(buf + 256 + 2 * t, in + 256 + 2 * t, 8);
  __pipeline_memcpy_async(buf + 384 + 4 * t, in + 384 + 4 * t, 16, 8);
  __pipeline_memcpy_async(buf + 640 + t, in + 640 + t, 4);
  __pipeline_commit();
  __pipeline_wait_prior(1);
  for (int i = 0; i < 4; ++i) out[4 * t + i] = buf[4 * t + i];
  __pipeline_wait_prior(0);
  __syncthreads();
  for (int i = 0; i < 4; ++i) out[256 + 4 * t + i] = buf[4 * m + i];
  for (int i = 0; i < 2; ++i) out[512 + 2 * t + i] = buf[256 + 2 * m + i];
  for (int i = 0; i < 4; ++i) out[640 + 4 * t + i] = buf[384 + 4 * m + i];
  out[896 + t] = buf[640 + m];
}

cudaError_t AsyncCopies(float* out, const float* in) {
  MS_LAUNCH(async_copy_kernel, 1, 64, 0, 0, out, in);
  return cudaGetLastError();
}

cudaError_t Shuffles(int* out, int threads, int width) {
  MS_LAUNCH(shuffles_kernel, 1, threads, 0, 0, out, width);
  return cudaGetLastError();
}
cudaError_t Votes(unsigned* out, int threads) {
  MS_LAUNCH(votes_kernel, 1, threads, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t HalfWarpShuffle(int* out, int threads) {
  MS_LAUNCH(half_warp_shuffle_kernel, 1, threads, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t BarrierVotes(int* out, int threads) {
  MS_LAUNCH(barrier_votes_kernel, 1, threads, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t Atomics(int* counters, float* fsum, unsigned long long* usum, int blocks, int threads) {
  MS_LAUNCH(atomics_kernel, blocks, threads, 0, 0, counters, fsum, usum);
  return cudaGetLastError();
}
cudaError_t Indexing(int* out, dim3 grid, dim3 block) {
  MS_LAUNCH(indexing_kernel, grid, block, 0, 0, out);
  return cudaGetLastError();
}
cudaError_t DynamicShared(float* out, int threads, size_t bytes, bool raise_limit) {
  if (raise_limit) {
    cudaError_t err = cudaFuncSetAttribute(dynamic_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  const int slots = static_cast<int>(bytes / sizeof(float) / threads);
  MS_LAUNCH(dynamic_shared_kernel, 1, threads, bytes, 0, out, slots);
  return cudaGetLastError();
}

// ---- one wmma step on 16x16 tiles (WmmaProbe in test_kernels.h) ----

namespace wmma = nvcuda::wmma;
constexpr int kFrag = 16;  // wmma m16n16k16

constexpr int kProbeMaxLd = 64;
constexpr int kProbeElems = kFrag * kProbeMaxLd;

template <bool kACol, bool kBCol>
__global__ void wmma_probe_kernel(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c,
                                  WmmaProbeArgs p) {
  MS_SHARED_ARRAY(__nv_bfloat16, sa, kProbeElems + kFrag);
  MS_SHARED_ARRAY(__nv_bfloat16, sb, kProbeElems);
  MS_SHARED_ARRAY(float, sc, kProbeElems);
  MS_SHARED_ARRAY(float, sd, kProbeElems);
  for (int i = threadIdx.x; i < kFrag * p.lda; i += blockDim.x) sa[p.a_offset + i] = a[i];
  for (int i = threadIdx.x; i < kFrag * p.ldb; i += blockDim.x) sb[i] = b[i];
  for (int i = threadIdx.x; i < kFrag * p.ldc; i += blockDim.x) {
    sc[i] = c[i];
    sd[i] = d[i];
  }
  __syncthreads();

  using LayoutA = std::conditional_t<kACol, wmma::col_major, wmma::row_major>;
  using LayoutB = std::conditional_t<kBCol, wmma::col_major, wmma::row_major>;
  wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, __nv_bfloat16, LayoutA> fa;
  wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, __nv_bfloat16, LayoutB> fb;
  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc;
  if (p.fill_a) {
    wmma::fill_fragment(fa, __float2bfloat16(p.fill_value));
  } else {
    wmma::load_matrix_sync(fa, sa + p.a_offset, p.lda);
  }
  for (int i = 0; i < fa.num_elements; ++i) fa.x[i] = __float2bfloat16(__bfloat162float(fa.x[i]) * p.scale_a);
  if (p.fill_b) {
    wmma::fill_fragment(fb, __float2bfloat16(p.fill_value));
  } else {
    wmma::load_matrix_sync(fb, sb, p.ldb);
  }
  if (p.fill_c) {
    wmma::fill_fragment(acc, p.fill_value);
  } else {
    wmma::load_matrix_sync(acc, sc, p.ldc, p.c_col ? wmma::mem_col_major : wmma::mem_row_major);
  }
  wmma::mma_sync(acc, fa, fb, acc);
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= p.scale_d;
  wmma::store_matrix_sync(sd, acc, p.ldc, p.d_col ? wmma::mem_col_major : wmma::mem_row_major);
  __syncthreads();
  for (int i = threadIdx.x; i < kFrag * p.ldc; i += blockDim.x) d[i] = sd[i];
}

cudaError_t WmmaProbe(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c,
                      const WmmaProbeArgs& args, cudaStream_t stream) {
  for (int ld : {args.lda, args.ldb, args.ldc}) {
    if (ld < kFrag || ld > kProbeMaxLd) return cudaErrorInvalidValue;
  }
  if (args.a_offset < 0 || args.a_offset > kFrag) return cudaErrorInvalidValue;
  if (args.a_col) {
    if (args.b_col) {
      MS_LAUNCH((wmma_probe_kernel<true, true>), 1, 32, 0, stream, d, a, b, c, args);
    } else {
      MS_LAUNCH((wmma_probe_kernel<true, false>), 1, 32, 0, stream, d, a, b, c, args);
    }
  } else {
    if (args.b_col) {
      MS_LAUNCH((wmma_probe_kernel<false, true>), 1, 32, 0, stream, d, a, b, c, args);
    } else {
      MS_LAUNCH((wmma_probe_kernel<false, false>), 1, 32, 0, stream, d, a, b, c, args);
    }
  }
  return cudaGetLastError();
}

}  // namespace ms::kernels::testing
