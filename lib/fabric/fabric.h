// megascale fabric: point-to-point messages over libfabric (OFI), the interface of the high-speed
// networks of GPU clusters (verbs for InfiniBand/RoCE, efa on AWS; tcp and shm here). Used by
// `megascale self-check` to measure every link; training traffic goes through Gloo or NCCL.
// defines: Endpoint (an RDM endpoint: reliable, unconnected messages), ListProviders
//
// An Endpoint owns its fabric, domain, completion queue, address vector and endpoint. Its address
// (Name()) is exchanged out of band (the job's store); AddPeer() makes a peer addressable. Send and
// Recv are blocking with a timeout (they post, then drive the completion queue); buffers are
// registered when the provider needs it (FI_MR_LOCAL). Errors name the provider, the call and
// libfabric's message. Not thread-safe: one thread per endpoint.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::fabric {

// The providers libfabric offers here with reliable unconnected (RDM) messages, e.g. tcp, shm.
Result<std::vector<std::string>> ListProviders();

class Endpoint {
 public:
  // Opens an RDM endpoint of `provider` ("tcp", "shm", "verbs", "efa", ...). NotFound listing the
  // providers that exist when it has none.
  static Result<std::unique_ptr<Endpoint>> Open(const std::string& provider);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const std::string& provider() const;  // the provider's full name, e.g. "tcp;ofi_rxm"
  // This endpoint's address, to give to peers (opaque bytes, hex-encoded).
  std::string Name() const;
  // Makes a peer's Name() addressable; returns its handle for Send/Recv.
  Result<uint64_t> AddPeer(const std::string& name);
  Status Send(const void* data, size_t bytes, uint64_t peer, double timeout_s);
  Status Recv(void* data, size_t bytes, uint64_t peer, double timeout_s);
  // Test hook (megascale self-check's injected slow link): every completed Send is followed by a
  // wait of (factor - 1) times its own duration. 1 (the default) leaves sends alone.
  void set_slowdown(double factor);

 private:
  struct Impl;
  explicit Endpoint(std::unique_ptr<Impl> impl);
  // They drive the endpoint's own buffers and in-flight operations.
  friend Result<double> PingPong(Endpoint& ep, uint64_t peer, bool initiator, size_t bytes, int iterations);
  friend Result<double> Stream(Endpoint& ep, uint64_t peer, bool sender, size_t bytes, int count);
  std::unique_ptr<Impl> impl_;
};

// Round trips of `bytes` between two endpoints (`initiator` sends first): the mean time of one
// round trip / 2 (the one-way latency), over `iterations`.
Result<double> PingPong(Endpoint& ep, uint64_t peer, bool initiator, size_t bytes, int iterations);
// One-way bandwidth: the sender streams `count` messages of `bytes`, the receiver acknowledges the
// last; bytes per second (on the sender; the receiver returns 0).
Result<double> Stream(Endpoint& ep, uint64_t peer, bool sender, size_t bytes, int count);

}  // namespace ms::fabric
