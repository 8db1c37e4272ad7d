// NCCL communicator: see nccl_comm.h. Compiled only with MS_HAVE_NCCL.
#include "comm/nccl_comm.h"

#include <cstring>

namespace ms::comm {
namespace {

#define MS_CUDA_CHECK(expr, what)                                                                        \
  do {                                                                                                   \
    cudaError_t ms_e_ = (expr);                                                                          \
    if (ms_e_ != cudaSuccess) {                                                                          \
      return Internal("{} ({}:{}): {}: {}", what, __FILE__, __LINE__, #expr, cudaGetErrorString(ms_e_)); \
    }                                                                                                    \
  } while (0)
#define MS_NCCL_CHECK(expr, what)                                                                           \
  do {                                                                                                      \
    ncclResult_t ms_r_ = (expr);                                                                            \
    if (ms_r_ != ncclSuccess) {                                                                             \
      return Unavailable("{} ({}:{}): {}: {}", what, __FILE__, __LINE__, #expr, ncclGetErrorString(ms_r_)); \
    }                                                                                                       \
  } while (0)

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

class NcclWork : public Work {
 public:
  NcclWork(cudaEvent_t ev, Status launch) : ev_(ev), status_(std::move(launch)) {}
  ~NcclWork() override {
    if (ev_) {
      Wait().IgnoreError();
      cudaEventDestroy(ev_);
    }
  }
  Status Wait() override {
    if (!status_.ok() || !ev_ || waited_) return status_;
    waited_ = true;
    cudaError_t e = cudaEventSynchronize(ev_);
    if (e != cudaSuccess) status_ = Internal("waiting for an NCCL operation: {}", cudaGetErrorString(e));
    return status_;
  }

 private:
  cudaEvent_t ev_;
  Status status_;
  bool waited_ = false;
};

class NcclCommunicator : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, NcclOptions options, cudaStream_t stream, int rank, int size)
      : comm_(comm), options_(std::move(options)), stream_(stream), rank_(rank), size_(size) {}
  ~NcclCommunicator() override {
    cudaStreamSynchronize(stream_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return options_.name; }

  std::unique_ptr<Work> AllReduce(float* d, int64_t n, ReduceOp op) override {
    return Run("all-reduce", [&] { return ncclAllReduce(d, d, n, ncclFloat, ToNccl(op), comm_, stream_); });
  }
  std::unique_ptr<Work> AllReduce(double* d, int64_t n, ReduceOp op) override {
    return Run("all-reduce", [&] { return ncclAllReduce(d, d, n, ncclDouble, ToNccl(op), comm_, stream_); });
  }
  std::unique_ptr<Work> AllReduce(int64_t* d, int64_t n, ReduceOp op) override {
    return Run("all-reduce", [&] { return ncclAllReduce(d, d, n, ncclInt64, ToNccl(op), comm_, stream_); });
  }
  std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t n) override {
    return Run("reduce-scatter", [&] { return ncclReduceScatter(in, out, n, ncclFloat, ncclSum, comm_, stream_); });
  }
  std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t n) override {
    return Run("all-gather", [&] { return ncclAllGather(in, out, n, ncclFloat, comm_, stream_); });
  }
  std::unique_ptr<Work> Broadcast(float* d, int64_t n, int root) override {
    return Run("broadcast", [&] { return ncclBroadcast(d, d, n, ncclFloat, root, comm_, stream_); });
  }
  std::unique_ptr<Work> Send(const float* d, int64_t n, int peer, int) override {
    return Run("send", [&] { return ncclSend(d, n, ncclFloat, peer, comm_, stream_); });
  }
  std::unique_ptr<Work> Recv(float* d, int64_t n, int peer, int) override {
    return Run("recv", [&] { return ncclRecv(d, n, ncclFloat, peer, comm_, stream_); });
  }
  Status Barrier() override {
    if (!barrier_buf_) {
      MS_CUDA_CHECK(cudaMalloc(&barrier_buf_, sizeof(float)), "barrier buffer");
    }
    return AllReduce(barrier_buf_, 1, ReduceOp::kSum)->Wait();
  }

 private:
  template <typename F>
  std::unique_ptr<Work> Run(const char* what, F&& op) {
    auto fail = [&](Status s) { return std::make_unique<NcclWork>(nullptr, std::move(s)); };
    const std::string ctx = fmt::format("{} on {} (rank {} of {})", what, options_.name, rank_, size_);
    cudaEvent_t ready = nullptr, done = nullptr;
    cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(ready, options_.compute_stream);
    if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, ready, 0);
    if (ready) cudaEventDestroy(ready);
    if (e != cudaSuccess)
      return fail(Internal("{}: ordering after the compute stream: {}", ctx, cudaGetErrorString(e)));
    ncclResult_t r = op();
    if (r != ncclSuccess) return fail(Unavailable("{}: {}", ctx, ncclGetErrorString(r)));
    e = cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
    if (e == cudaSuccess) e = cudaEventRecord(done, stream_);
    if (e != cudaSuccess) return fail(Internal("{}: completion event: {}", ctx, cudaGetErrorString(e)));
    return std::make_unique<NcclWork>(done, Status::Ok());
  }

  ncclComm_t comm_;
  NcclOptions options_;
  cudaStream_t stream_;
  int rank_, size_;
  float* barrier_buf_ = nullptr;
};

}  // namespace

Result<std::unique_ptr<Communicator>> MakeNcclCommunicator(ncclComm_t comm, NcclOptions options) {
  int rank = 0, size = 0;
  MS_NCCL_CHECK(ncclCommUserRank(comm, &rank), "NCCL communicator rank");
  MS_NCCL_CHECK(ncclCommCount(comm, &size), "NCCL communicator size");
  cudaStream_t stream = nullptr;
  MS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "communication stream");
  return std::unique_ptr<Communicator>(new NcclCommunicator(comm, std::move(options), stream, rank, size));
}

Result<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  MS_NCCL_CHECK(ncclGetUniqueId(&id), "creating an NCCL unique id");
  return std::string(reinterpret_cast<const char*>(&id), sizeof id);
}

Result<ncclComm_t> InitNcclComm(const std::string& id_bytes, int rank, int size) {
  ncclUniqueId id;
  if (id_bytes.size() != sizeof id) {
    return InvalidArgument("NCCL unique id has {} bytes, expected {}", id_bytes.size(), sizeof id);
  }
  std::memcpy(&id, id_bytes.data(), sizeof id);
  ncclComm_t comm = nullptr;
  MS_NCCL_CHECK(ncclCommInitRank(&comm, size, id, rank), fmt::format("ncclCommInitRank (rank {} of {})", rank, size));
  return comm;
}

}  // namespace ms::comm
