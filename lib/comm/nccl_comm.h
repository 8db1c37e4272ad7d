// The NCCL communicator (CUDA backend). Compiled only when nvcc and NCCL are present
// (MS_HAVE_NCCL); included by comm.h users through MakeNcclCommunicator when available.
//
// Design: each communicator owns one non-blocking CUDA stream. A call first makes that stream
// wait for an event recorded on the caller's compute stream (so it sees the data the compute
// produced), enqueues the NCCL operation, records a completion event and returns a Work whose
// Wait() synchronizes that event (host) — compute streams instead wait on the device with
// StreamWaitFor(). Collectives run in issue order on the stream; NCCL send/recv between a pair
// are matched in posting order (the tag is only checked for sanity: NCCL has no tags), so the
// pipeline schedule posts them in the same order on both sides.
// Errors: every CUDA and NCCL call is checked; the Status names the communicator, the
// operation, the CUDA/NCCL error string and file:line. Not exercised without a GPU.
#pragma once

#include <memory>
#include <string>

#include "comm/comm.h"

#if defined(MS_HAVE_NCCL)
#include <cuda_runtime.h>
#include <nccl.h>

namespace ms::comm {

struct NcclOptions {
  std::string name = "nccl";
  cudaStream_t compute_stream = nullptr;  // the stream that produces and consumes the buffers (default stream: 0)
};

// Takes ownership of `comm` (ncclCommDestroy at the end). Fails if the stream or events cannot be created.
Result<std::unique_ptr<Communicator>> MakeNcclCommunicator(ncclComm_t comm, NcclOptions options);

// The 128-byte id every member of a group passes to ncclCommInitRank, as bytes (for a store).
Result<std::string> NewNcclUniqueId();
// ncclCommInitRank from an id produced by NewNcclUniqueId on the group's leader.
Result<ncclComm_t> InitNcclComm(const std::string& id_bytes, int rank, int size);

}  // namespace ms::comm
#endif  // MS_HAVE_NCCL
