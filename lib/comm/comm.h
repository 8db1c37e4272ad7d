// Communicator: collectives and point-to-point transfers within one process group.
//
// Every call is asynchronous: it returns a Work handle at once, the transfer runs on the
// communicator's own thread (Gloo, CPU backend) or stream (NCCL, CUDA backend), and the
// caller overlaps compute until it calls Wait(). Buffers must stay valid and untouched
// until then. Calls on one communicator are executed in the order they were issued, and
// every member of the group must issue the same collectives in the same order.
//
// This issue ships the single-rank communicator (a group of one: every collective is an
// identity, completed at once). The Gloo and NCCL communicators plug in behind the same
// interface (3D-parallelism and CUDA issues).
#pragma once

#include <cstdint>
#include <memory>

#include "core/core.h"

namespace ms::comm {

enum class ReduceOp { kSum, kMax };

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation is complete; returns its error (peer failure, timeout).
  virtual Status Wait() = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place over `count` floats.
  virtual std::unique_ptr<Work> AllReduce(float* data, int64_t count, ReduceOp op) = 0;
  // in: size()*count floats; out: this rank's `count` floats of the reduced result.
  virtual std::unique_ptr<Work> ReduceScatter(const float* in, float* out, int64_t count) = 0;
  // in: `count` floats of this rank; out: size()*count floats, rank-major.
  virtual std::unique_ptr<Work> AllGather(const float* in, float* out, int64_t count) = 0;
  virtual std::unique_ptr<Work> Broadcast(float* data, int64_t count, int root) = 0;
  virtual std::unique_ptr<Work> Send(const float* data, int64_t count, int peer, int tag) = 0;
  virtual std::unique_ptr<Work> Recv(float* data, int64_t count, int peer, int tag) = 0;
  virtual Status Barrier() = 0;
};

// A group of one rank (the 1x1x1 layout, or any group of size 1 in a larger layout).
std::unique_ptr<Communicator> MakeSelfCommunicator();

}  // namespace ms::comm
