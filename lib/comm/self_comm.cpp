#include <cstring>

#include "comm/comm.h"

namespace ms::comm {
namespace {

class SelfCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "self"; }
  std::unique_ptr<Work> AllReduce(float*, int64_t, ReduceOp) override { return CompletedWork(); }
  std::unique_ptr<Work> AllReduce(double*, int64_t, ReduceOp) override { return CompletedWork(); }
  std::unique_ptr<Work> AllReduce(int64_t*, int64_t, ReduceOp) override { return CompletedWork(); }
  std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t count) override {
    if (in != out && count > 0) std::memmove(out, in, static_cast<size_t>(count) * sizeof(float));
    return CompletedWork();
  }
  std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t count) override {
    if (in != out && count > 0) std::memmove(out, in, static_cast<size_t>(count) * sizeof(float));
    return CompletedWork();
  }
  std::unique_ptr<Work> AllGather16(const uint16_t* in, uint16_t* out, int64_t count) override {
    if (in != out && count > 0) std::memmove(out, in, static_cast<size_t>(count) * sizeof(uint16_t));
    return CompletedWork();
  }
  std::unique_ptr<Work> AllReduce16(uint16_t*, int64_t) override { return CompletedWork(); }
  std::unique_ptr<Work> ReduceScatter16(const uint16_t* in, uint16_t* out, int64_t count) override {
    if (in != out && count > 0) std::memmove(out, in, static_cast<size_t>(count) * sizeof(uint16_t));
    return CompletedWork();
  }
  std::unique_ptr<Work> Broadcast(float*, int64_t, int root) override {
    if (root != 0) return CompletedWork(InvalidArgument("broadcast root {} in a group of 1", root));
    return CompletedWork();
  }
  std::unique_ptr<Work> Send(const float*, int64_t, int peer, int) override {
    return CompletedWork(InvalidArgument("send to rank {} in a group of 1", peer));
  }
  std::unique_ptr<Work> Recv(float*, int64_t, int peer, int) override {
    return CompletedWork(InvalidArgument("recv from rank {} in a group of 1", peer));
  }
  Status Barrier() override { return Status::Ok(); }
};

}  // namespace

std::unique_ptr<Communicator> MakeSelfCommunicator() {
  return std::make_unique<SelfCommunicator>();
}

}  // namespace ms::comm
