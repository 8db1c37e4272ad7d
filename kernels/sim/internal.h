// kernels/sim/internal.h: what the scheduler (simt.cpp) and the CUDA runtime subset (runtime.cpp) share.
// Not for kernels or tests.
#pragma once

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>
#include <string>

#include "sim/runtime_hooks.h"

namespace ms::sim::internal {

constexpr size_t kDefaultSharedLimit = 48 * 1024;  // static shared, and dynamic without opt-in
constexpr size_t kMaxSharedOptIn = 227 * 1024;     // sm_90's opt-in maximum per block
constexpr unsigned char kPoisonByte = 0xFF;        // fill of cudaMalloc'd and shared memory (NaN, -1)

// The calling host thread's last CUDA error (what cudaGetLastError returns and clears).
void SetLastError(cudaError_t error);
// The dynamic shared memory a kernel may use: kDefaultSharedLimit unless raised with cudaFuncSetAttribute.
size_t MaxDynamicSharedBytes(const void* kernel);
// Records the message for ms::sim::LastErrorMessage() and prints it on stderr ("ms-sim: error: ...")
// unless MS_SIM_QUIET=1; aborts the process if MS_SIM_ABORT=1 (to get a core file or a debugger stop).
void ReportError(const std::string& message);

// Streams and events (streams.cpp). Handles are the engine's objects; the legacy/per-thread/null stream is one
// blocking stream. Errors are cudaErrorInvalidResourceHandle for unknown handles, or a stream's sticky error.
bool AsyncStreams();
bool KnownStreamHandle(cudaStream_t stream);
bool KnownEventHandle(cudaEvent_t event);
cudaStream_t NewStream(bool blocking);
cudaError_t DestroyStream(cudaStream_t stream);
cudaError_t Enqueue(cudaStream_t stream, const char* what, StreamOp op);
cudaError_t SynchronizeStream(cudaStream_t stream);
cudaError_t QueryStream(cudaStream_t stream);
cudaError_t SynchronizeDevice();
cudaEvent_t NewEvent();
cudaError_t DestroyEvent(cudaEvent_t event);
cudaError_t RecordEvent(cudaEvent_t event, cudaStream_t stream);
cudaError_t StreamWaitEvent(cudaStream_t stream, cudaEvent_t event);
cudaError_t SynchronizeEvent(cudaEvent_t event);
cudaError_t QueryEvent(cudaEvent_t event);
cudaError_t EventTime(cudaEvent_t event, std::chrono::steady_clock::time_point* t);
// Stream capture (streams.cpp's header comment). EndCapture's `why`: the reason of an invalidated capture.
// Graphs and executable graphs are both the engine's graph objects (CopyGraph makes the executable one).
bool AnyCapture();
// cudaErrorStreamCaptureUnsupported, invalidating the capture, where `stream` is capturing (an operation CUDA
// cannot capture, e.g. a copy from pageable memory); cudaSuccess otherwise.
cudaError_t RefuseInCapture(cudaStream_t stream, const std::string& why);
cudaError_t BeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t EndCapture(cudaStream_t stream, cudaGraph_t* graph, std::string* why);
cudaError_t CaptureStatus(cudaStream_t stream, cudaStreamCaptureStatus* status);
cudaError_t CopyGraph(cudaGraph_t graph, void** copy);
cudaError_t DestroyGraph(void* graph);
cudaError_t GraphOps(cudaGraph_t graph, size_t* n);
cudaError_t LaunchGraph(void* exec, cudaStream_t stream);

}  // namespace ms::sim::internal
