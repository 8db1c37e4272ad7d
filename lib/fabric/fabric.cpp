// Endpoint, ListProviders, PingPong, Stream: RDM messages over libfabric with polled completions.
//
// Every operation carries an Op (its fi_context first) that lives in the endpoint, so a completion
// that arrives after its call gave up (a timeout) still lands in valid memory; such an endpoint is
// marked broken and refuses further calls. Send/Recv copy through bounce buffers owned by the
// endpoint (registered when the provider asks for FI_MR_LOCAL); PingPong and Stream use them directly.
//
// libfabric is loaded at the first ListProviders or Endpoint::Open (dlopen), not linked: loading it loads its
// providers' libraries, and one of them (libinfinipath, under the psm provider) sleeps about 0.2 s in its constructor,
// which every megascale process would pay, and only self-check uses libfabric. Its five exported functions are called
// through Api(); the rest of its interface is inline functions that call through the objects' operation tables.
#include "fabric/fabric.h"

#include <dlfcn.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>

#include <fmt/ranges.h>

namespace ms::fabric {
namespace {

// The memory registration modes this code handles: local buffers registered, virtual addresses,
// allocated memory only, keys chosen by the provider.
constexpr uint64_t kMrModes = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
constexpr int kStreamWindow = 16;                  // Stream: sends (and receives) in flight
constexpr size_t kStreamRecvRingBytes = 64 << 20;  // Stream: the receiver's ring of posted buffers
constexpr int kWarmupRoundTrips = 5;               // PingPong: untimed round trips first
constexpr double kStallTimeoutS = 60;              // PingPong/Stream: longest wait for a completion
constexpr size_t kAckBytes = 8;                    // Stream: the receiver's acknowledgement
constexpr size_t kPageBytes = 4096;
constexpr int kSpinPolls = 5000;  // empty completion queue reads before polling starts to yield

uint32_t ApiVersion() {
  return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION);
}

// libfabric's exported functions this file calls, from the library loaded by LoadApi.
struct FabricApi {
  decltype(&fi_getinfo) getinfo = nullptr;
  decltype(&fi_freeinfo) freeinfo = nullptr;
  decltype(&fi_dupinfo) dupinfo = nullptr;  // fi_allocinfo is fi_dupinfo(nullptr)
  decltype(&fi_fabric) fabric = nullptr;
  decltype(&fi_strerror) strerror = nullptr;
};
constexpr const char* kLibfabric = "libfabric.so.1";

// Loads libfabric once per process; the outcome (the table, or why not) is kept for later calls.
const Result<const FabricApi*>& LoadApi() {
  static const Result<const FabricApi*> loaded = []() -> Result<const FabricApi*> {
    void* lib = dlopen(kLibfabric, RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) {
      const char* why = dlerror();
      return Unavailable("libfabric: cannot load {} ({}): install libfabric (Debian: apt install libfabric1)",
                         kLibfabric, why != nullptr ? why : "no reason given");
    }
    static FabricApi api;  // the library stays loaded for the process's life
    auto find = [lib](auto& fn, const char* name) -> Status {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (fn == nullptr) return Unavailable("libfabric: {} has no function {}; is it libfabric 1.x?", kLibfabric, name);
      return Status::Ok();
    };
    MS_RETURN_IF_ERROR(find(api.getinfo, "fi_getinfo"));
    MS_RETURN_IF_ERROR(find(api.freeinfo, "fi_freeinfo"));
    MS_RETURN_IF_ERROR(find(api.dupinfo, "fi_dupinfo"));
    MS_RETURN_IF_ERROR(find(api.fabric, "fi_fabric"));
    MS_RETURN_IF_ERROR(find(api.strerror, "fi_strerror"));
    return &api;
  }();
  return loaded;
}

// The loaded table; only called after a successful LoadApi (ListProviders and Endpoint::Open load it first).
const FabricApi& Api() {
  return **LoadApi();
}

std::string FiMessage(long ret) {
  return fmt::format("{} ({})", Api().strerror(static_cast<int>(-ret)), ret);
}

struct InfoFree {
  void operator()(fi_info* info) const { Api().freeinfo(info); }
};
using InfoPtr = std::unique_ptr<fi_info, InfoFree>;

// Hints for reliable unconnected messages with `caps`, of `provider` (nullptr: any).
Result<InfoPtr> MakeHints(const char* provider, uint64_t caps, bool ordered) {
  InfoPtr hints(Api().dupinfo(nullptr));
  if (!hints) return Internal("libfabric: fi_allocinfo: out of memory");
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = caps;
  hints->mode = FI_CONTEXT;
  hints->domain_attr->mr_mode = static_cast<int>(kMrModes);
  if (ordered) {
    hints->tx_attr->msg_order = FI_ORDER_SAS;
    hints->rx_attr->msg_order = FI_ORDER_SAS;
  }
  if (provider != nullptr) {
    hints->fabric_attr->prov_name = strdup(provider);  // fi_freeinfo frees it
    if (hints->fabric_attr->prov_name == nullptr) return Internal("libfabric: strdup: out of memory");
  }
  return hints;
}

std::string Hex(const uint8_t* data, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(kDigits[data[i] >> 4]);
    out.push_back(kDigits[data[i] & 15]);
  }
  return out;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

bool Unhex(const std::string& text, std::vector<uint8_t>* out) {
  if (text.empty() || text.size() % 2 != 0) return false;
  out->clear();
  for (size_t i = 0; i < text.size(); i += 2) {
    int hi = HexDigit(text[i]), lo = HexDigit(text[i + 1]);
    if (hi < 0 || lo < 0) return false;
    out->push_back(static_cast<uint8_t>(hi * 16 + lo));
  }
  return true;
}

// The status for a completion error (fi_cq_err_entry::err, a positive FI_E* code).
Code CompletionCode(int err) {
  switch (err) {
    case FI_ETRUNC:
      return Code::kDataLoss;
    case FI_ECANCELED:
      return Code::kAborted;
    case FI_ECONNREFUSED:
    case FI_ECONNRESET:
    case FI_ECONNABORTED:
    case FI_EHOSTUNREACH:
    case FI_ENOTCONN:
    case FI_ETIMEDOUT:
      return Code::kUnavailable;
    default:
      return Code::kIo;
  }
}

// Waits `seconds` without driving the provider, busy: the thread stays on its core as a sender held
// by a slow link would (sleeping instead hands the core to the peer, which on a crowded machine
// hides the slowdown).
void Pause(double seconds) {
  double until = NowSeconds() + seconds;
  while (NowSeconds() < until) {
  }
}

}  // namespace

// One posted operation. Lives in the endpoint for the endpoint's lifetime.
struct Op {
  fi_context ctx;  // first: what libfabric hands back as the completion's op_context
  const char* call = "";
  bool busy = false;  // posted and its completion not yet consumed
  bool done = false;  // its completion (or completion error) was read
  Status status;      // the completion error, if any
  size_t len = 0;     // bytes received (receives)
  double posted_at = 0;
  double completed_at = 0;
};

// A bounce buffer, page aligned, registered when the provider needs FI_MR_LOCAL.
struct Buffer {
  uint8_t* data = nullptr;
  size_t size = 0;
  fid_mr* mr = nullptr;
  void* desc() const { return mr != nullptr ? fi_mr_desc(mr) : nullptr; }
};

struct Endpoint::Impl {
  std::string provider;  // the full name, e.g. "tcp;ofi_rxm"
  std::string name;      // hex of fi_getname
  fi_info* info = nullptr;
  fid_fabric* fabric = nullptr;
  fid_domain* domain = nullptr;
  fid_cq* cq = nullptr;
  fid_av* av = nullptr;
  fid_ep* ep = nullptr;
  bool directed_recv = false;  // Recv filters by source; else it takes FI_ADDR_UNSPEC
  bool register_buffers = false;
  size_t max_msg_size = 0;
  std::vector<uint64_t> peers;  // AddPeer's handles
  Buffer send_buf, recv_buf;
  Op send_op, recv_op;
  std::array<Op, kStreamWindow> stream_ops;
  double slowdown = 1;
  std::string broken;  // why the endpoint refuses calls; empty while usable
  int idle_polls = 0;  // completion queue reads in a row that found nothing

  ~Impl() {
    // Reverse order of creation; the endpoint first, so nothing still writes into the buffers.
    if (ep != nullptr) fi_close(&ep->fid);
    if (av != nullptr) fi_close(&av->fid);
    if (cq != nullptr) fi_close(&cq->fid);
    for (Buffer* b : {&send_buf, &recv_buf}) {
      if (b->mr != nullptr) fi_close(&b->mr->fid);
      std::free(b->data);
    }
    if (domain != nullptr) fi_close(&domain->fid);
    if (fabric != nullptr) fi_close(&fabric->fid);
    if (info != nullptr) Api().freeinfo(info);
  }

  // An error from libfabric call `call` that returned `ret` (a negative FI_E* code).
  Status Fail(const char* call, long ret) const {
    Code code = ret == -FI_ENOMEM ? Code::kInternal : Code::kIo;
    return Status(code, fmt::format("libfabric {}: {} failed: {}", provider, call, FiMessage(ret)));
  }

  Status Usable() const {
    if (broken.empty()) return Status::Ok();
    return FailedPrecondition("libfabric {} endpoint is unusable: {}; open a new endpoint", provider, broken);
  }

  Status CheckPeer(uint64_t peer) const {
    if (std::find(peers.begin(), peers.end(), peer) != peers.end()) return Status::Ok();
    return InvalidArgument("libfabric {}: peer {} was not added with AddPeer", provider, peer);
  }

  Status CheckSize(size_t bytes) const {
    if (bytes <= max_msg_size) return Status::Ok();
    return InvalidArgument("libfabric {}: a message of {} bytes exceeds the provider's maximum of {}", provider, bytes,
                           max_msg_size);
  }

  // Makes `b` hold at least `bytes`. Only called while no operation uses it (an endpoint with an
  // operation left in flight is broken and gets here no more).
  Status Reserve(Buffer& b, size_t bytes) {
    if (b.data != nullptr && bytes <= b.size) return Status::Ok();
    if (b.mr != nullptr) {
      int ret = fi_close(&b.mr->fid);
      b.mr = nullptr;
      if (ret != 0) return Fail("fi_close (memory region)", ret);
    }
    std::free(b.data);
    b.data = nullptr;
    b.size = 0;
    size_t size = std::max(kPageBytes, (bytes + kPageBytes - 1) / kPageBytes * kPageBytes);
    auto* data = static_cast<uint8_t*>(std::aligned_alloc(kPageBytes, size));
    if (data == nullptr) return Internal("libfabric {}: out of memory allocating a {}-byte buffer", provider, size);
    std::memset(data, 0, size);
    if (register_buffers) {
      int ret = fi_mr_reg(domain, data, size, FI_SEND | FI_RECV, 0, 0, 0, &b.mr, nullptr);
      if (ret != 0) {
        b.mr = nullptr;
        std::free(data);
        return Fail("fi_mr_reg", ret);
      }
    }
    b.data = data;
    b.size = size;
    return Status::Ok();
  }

  Op* FindOp(void* context) {
    for (Op* op : {&send_op, &recv_op}) {
      if (&op->ctx == context) return op;
    }
    for (Op& op : stream_ops) {
      if (&op.ctx == context) return &op;
    }
    return nullptr;
  }

  // Reads what the completion queue holds (without waiting) and marks those operations done. An
  // error is returned only for failures not tied to one operation; those carry it in Op::status.
  Status Progress() {
    std::array<fi_cq_msg_entry, 16> entries;
    ssize_t n = fi_cq_read(cq, entries.data(), entries.size());
    if (n == -FI_EAGAIN) {
      // Spin first (latency), then let other threads run: the peer may share this core.
      if (++idle_polls > kSpinPolls) std::this_thread::yield();
      return Status::Ok();
    }
    idle_polls = 0;
    if (n > 0) {
      double now = NowSeconds();
      for (ssize_t i = 0; i < n; ++i) {
        Op* op = FindOp(entries[i].op_context);
        if (op == nullptr) return Internal("libfabric {}: a completion for an unknown operation", provider);
        op->done = true;
        op->len = entries[i].len;
        op->completed_at = now;
      }
      return Status::Ok();
    }
    if (n != -FI_EAVAIL) return Fail("fi_cq_read", n);
    fi_cq_err_entry err{};
    ssize_t r = fi_cq_readerr(cq, &err, 0);
    if (r == -FI_EAGAIN) return Status::Ok();
    if (r < 0) return Fail("fi_cq_readerr", r);
    std::array<char, 256> text{};
    const char* detail = fi_cq_strerror(cq, err.prov_errno, err.err_data, text.data(), text.size());
    Op* op = FindOp(err.op_context);
    int code = err.err < 0 ? -err.err : err.err;  // shm 1.17 reports it negated
    Status status(CompletionCode(code),
                  fmt::format("libfabric {}: {} completed with an error: {} ({}); provider error {}: {}", provider,
                              op != nullptr ? op->call : "an operation", Api().strerror(code), code, err.prov_errno,
                              detail != nullptr ? detail : "(none)"));
    // tcp;ofi_rxm drops the connection of a truncated message, losing what follows on it silently.
    if (code == FI_ETRUNC) MarkBroken("a message larger than its receive buffer arrived truncated");
    if (op == nullptr) return status;
    op->done = true;
    op->status = status;
    op->len = err.len;
    op->completed_at = NowSeconds();
    return Status::Ok();
  }

  void MarkBroken(std::string why) {
    if (broken.empty()) broken = std::move(why);
  }

  bool AnyBusy() const {
    if (send_op.busy || recv_op.busy) return true;
    return std::any_of(stream_ops.begin(), stream_ops.end(), [](const Op& op) { return op.busy; });
  }

  Status TimedOut(const char* what, double deadline, double started) {
    MarkBroken(fmt::format("{} timed out and may still complete into the endpoint's buffers", what));
    return Timeout("libfabric {}: {} timed out after {:.3f} s", provider, what, deadline - started);
  }

  // Posts a send (receive: `recv`) of `len` bytes at `buf`, retrying while the provider is out of
  // resources and driving completions meanwhile.
  Status Post(Op& op, bool recv, void* buf, size_t len, void* desc, uint64_t peer, double deadline) {
    op.call = recv ? "fi_recv" : "fi_send";
    op.done = false;
    op.status = Status::Ok();
    op.len = 0;
    double started = NowSeconds();
    for (;;) {
      op.posted_at = NowSeconds();
      ssize_t ret = recv ? fi_recv(ep, buf, len, desc, directed_recv ? peer : FI_ADDR_UNSPEC, &op.ctx)
                         : fi_send(ep, buf, len, desc, peer, &op.ctx);
      if (ret == 0) break;
      if (ret != -FI_EAGAIN) return Fail(op.call, ret);
      Status s = Progress();
      if (!s.ok()) {
        MarkBroken(fmt::format("reading completions failed: {}", s.message()));
        return s;
      }
      if (NowSeconds() > deadline) return TimedOut(recv ? "posting a receive" : "posting a send", deadline, started);
    }
    op.busy = true;
    return Status::Ok();
  }

  // Drives completions until `op` completes; returns its completion status.
  Status Wait(Op& op, double deadline) {
    while (!op.done) {
      Status s = Progress();
      if (!s.ok()) {
        MarkBroken(fmt::format("reading completions failed: {}", s.message()));
        return s;
      }
      if (op.done) break;
      if (NowSeconds() > deadline) {
        return TimedOut(op.call == std::string_view("fi_recv") ? "a receive" : "a send", deadline, op.posted_at);
      }
    }
    op.busy = false;
    return op.status;
  }

  Status CheckLength(const Op& op, size_t expected) const {
    if (op.len == expected) return Status::Ok();
    return DataLoss("libfabric {}: received a {}-byte message where {} bytes were expected", provider, op.len,
                    expected);
  }

  // The test hook: a send that took `seconds` is followed by a wait of (slowdown - 1) times that.
  void SlowDown(double seconds) {
    if (slowdown > 1 && seconds > 0) Pause((slowdown - 1) * seconds);
  }

  // Sends `len` bytes of send_buf and waits for the completion (then the slowdown).
  Status SendBuffered(size_t len, uint64_t peer, double deadline) {
    MS_RETURN_IF_ERROR(Post(send_op, false, send_buf.data, len, send_buf.desc(), peer, deadline));
    MS_RETURN_IF_ERROR(Wait(send_op, deadline));
    SlowDown(send_op.completed_at - send_op.posted_at);
    return Status::Ok();
  }

  Result<double> PingPong(uint64_t peer, bool initiator, size_t bytes, int iterations);
  Result<double> StreamSend(uint64_t peer, size_t bytes, int count);
  Result<double> StreamRecv(uint64_t peer, size_t bytes, int count);
};

Endpoint::Endpoint(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Endpoint::~Endpoint() = default;

Result<std::vector<std::string>> ListProviders() {
  MS_RETURN_IF_ERROR(LoadApi().status());
  MS_ASSIGN_OR_RETURN(InfoPtr hints, MakeHints(nullptr, FI_MSG, false));
  fi_info* list = nullptr;
  int ret = Api().getinfo(ApiVersion(), nullptr, nullptr, 0, hints.get(), &list);
  if (ret == -FI_ENODATA) return std::vector<std::string>{};
  if (ret != 0) return Unavailable("libfabric: fi_getinfo (reliable unconnected messages) failed: {}", FiMessage(ret));
  InfoPtr owned(list);
  std::vector<std::string> names;
  for (const fi_info* i = list; i != nullptr; i = i->next) {
    if (i->fabric_attr == nullptr || i->fabric_attr->prov_name == nullptr) continue;
    // "tcp;ofi_rxm" is the tcp provider under the rxm utility: Open takes the first part.
    std::string name(i->fabric_attr->prov_name);
    name = name.substr(0, name.find(';'));
    if (!name.empty() && std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  return names;
}

Result<std::unique_ptr<Endpoint>> Endpoint::Open(const std::string& provider) {
  if (provider.empty()) return InvalidArgument("libfabric: no provider named (e.g. tcp, shm, verbs, efa)");
  MS_RETURN_IF_ERROR(LoadApi().status());
  // Most wanted first: receives filtered by source, messages matched in order.
  struct Want {
    uint64_t caps;
    bool ordered;
  };
  constexpr std::array<Want, 4> kWants = {Want{FI_MSG | FI_DIRECTED_RECV, true}, Want{FI_MSG, true},
                                          Want{FI_MSG | FI_DIRECTED_RECV, false}, Want{FI_MSG, false}};
  fi_info* info = nullptr;
  int ret = -FI_ENODATA;
  for (const Want& want : kWants) {
    MS_ASSIGN_OR_RETURN(InfoPtr hints, MakeHints(provider.c_str(), want.caps, want.ordered));
    ret = Api().getinfo(ApiVersion(), nullptr, nullptr, 0, hints.get(), &info);
    if (ret != -FI_ENODATA) break;
  }
  if (ret == -FI_ENODATA) {
    auto available = ListProviders();
    std::string names = available.ok() ? fmt::format("{}", fmt::join(*available, ", "))
                                       : fmt::format("(listing them failed: {})", available.status().message());
    if (available.ok() && available->empty()) names = "none";
    return NotFound(
        "libfabric has no provider '{}' with reliable unconnected messages (FI_EP_RDM, FI_MSG) usable here; "
        "providers available: {}",
        provider, names);
  }
  if (ret != 0) return Unavailable("libfabric {}: fi_getinfo failed: {}", provider, FiMessage(ret));

  auto impl = std::make_unique<Impl>();
  Impl& m = *impl;
  m.info = info;  // the whole list; the first entry is used
  m.provider = info->fabric_attr->prov_name != nullptr ? info->fabric_attr->prov_name : provider;
  m.directed_recv = (info->caps & FI_DIRECTED_RECV) != 0;
  m.register_buffers = (static_cast<uint64_t>(info->domain_attr->mr_mode) & FI_MR_LOCAL) != 0;
  m.max_msg_size = info->ep_attr->max_msg_size;

  ret = Api().fabric(info->fabric_attr, &m.fabric, nullptr);
  if (ret != 0) return m.Fail("fi_fabric", ret);
  ret = fi_domain(m.fabric, info, &m.domain, nullptr);
  if (ret != 0) return m.Fail("fi_domain", ret);
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_MSG;  // op_context plus the received length
  cq_attr.wait_obj = FI_WAIT_NONE;    // polled
  ret = fi_cq_open(m.domain, &cq_attr, &m.cq, nullptr);
  if (ret != 0) return m.Fail("fi_cq_open", ret);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  ret = fi_av_open(m.domain, &av_attr, &m.av, nullptr);
  if (ret != 0) return m.Fail("fi_av_open", ret);
  ret = fi_endpoint(m.domain, info, &m.ep, nullptr);
  if (ret != 0) return m.Fail("fi_endpoint", ret);
  ret = fi_ep_bind(m.ep, &m.av->fid, 0);
  if (ret != 0) return m.Fail("fi_ep_bind (address vector)", ret);
  ret = fi_ep_bind(m.ep, &m.cq->fid, FI_TRANSMIT | FI_RECV);
  if (ret != 0) return m.Fail("fi_ep_bind (completion queue)", ret);
  ret = fi_enable(m.ep);
  if (ret != 0) return m.Fail("fi_enable", ret);

  std::vector<uint8_t> address(64);
  size_t len = address.size();
  ret = fi_getname(&m.ep->fid, address.data(), &len);
  if (ret == -FI_ETOOSMALL) {
    address.resize(len);
    ret = fi_getname(&m.ep->fid, address.data(), &len);
  }
  if (ret != 0) return m.Fail("fi_getname", ret);
  m.name = Hex(address.data(), std::min(len, address.size()));
  return std::unique_ptr<Endpoint>(new Endpoint(std::move(impl)));
}

const std::string& Endpoint::provider() const {
  return impl_->provider;
}

std::string Endpoint::Name() const {
  return impl_->name;
}

Result<uint64_t> Endpoint::AddPeer(const std::string& name) {
  Impl& m = *impl_;
  MS_RETURN_IF_ERROR(m.Usable());
  std::vector<uint8_t> address;
  if (!Unhex(name, &address)) {
    return InvalidArgument("libfabric {}: peer name '{}' is not a hex-encoded address (an Endpoint::Name())",
                           m.provider, name);
  }
  // String addresses (shm's "fi_shm://...") are read up to their terminating NUL.
  if (m.info->addr_format == FI_ADDR_STR && address.back() != 0) address.push_back(0);
  fi_addr_t addr = FI_ADDR_NOTAVAIL;
  int ret = fi_av_insert(m.av, address.data(), 1, &addr, 0, nullptr);
  if (ret < 0) return m.Fail("fi_av_insert", ret);
  if (ret != 1 || addr == FI_ADDR_NOTAVAIL) {
    return InvalidArgument("libfabric {}: fi_av_insert rejected the peer address {}", m.provider, name);
  }
  m.peers.push_back(addr);
  return static_cast<uint64_t>(addr);
}

Status Endpoint::Send(const void* data, size_t bytes, uint64_t peer, double timeout_s) {
  Impl& m = *impl_;
  MS_RETURN_IF_ERROR(m.Usable());
  MS_RETURN_IF_ERROR(m.CheckPeer(peer));
  MS_RETURN_IF_ERROR(m.CheckSize(bytes));
  if (data == nullptr && bytes > 0) {
    return InvalidArgument("libfabric {}: Send of {} bytes from null", m.provider, bytes);
  }
  if (!(timeout_s >= 0)) return InvalidArgument("libfabric {}: Send timeout {} is not >= 0", m.provider, timeout_s);
  double deadline = NowSeconds() + timeout_s;
  MS_RETURN_IF_ERROR(m.Reserve(m.send_buf, bytes));
  if (bytes > 0) std::memcpy(m.send_buf.data, data, bytes);
  return m.SendBuffered(bytes, peer, deadline);
}

Status Endpoint::Recv(void* data, size_t bytes, uint64_t peer, double timeout_s) {
  Impl& m = *impl_;
  MS_RETURN_IF_ERROR(m.Usable());
  MS_RETURN_IF_ERROR(m.CheckPeer(peer));
  MS_RETURN_IF_ERROR(m.CheckSize(bytes));
  if (data == nullptr && bytes > 0) {
    return InvalidArgument("libfabric {}: Recv of {} bytes into null", m.provider, bytes);
  }
  if (!(timeout_s >= 0)) return InvalidArgument("libfabric {}: Recv timeout {} is not >= 0", m.provider, timeout_s);
  double deadline = NowSeconds() + timeout_s;
  MS_RETURN_IF_ERROR(m.Reserve(m.recv_buf, bytes));
  // The whole buffer is offered, so a somewhat longer message arrives whole and is reported below
  // rather than truncated by the provider (which breaks the endpoint, see Progress).
  size_t offered = std::min(m.recv_buf.size, m.max_msg_size);
  MS_RETURN_IF_ERROR(m.Post(m.recv_op, true, m.recv_buf.data, offered, m.recv_buf.desc(), peer, deadline));
  MS_RETURN_IF_ERROR(m.Wait(m.recv_op, deadline));
  MS_RETURN_IF_ERROR(m.CheckLength(m.recv_op, bytes));
  if (bytes > 0) std::memcpy(data, m.recv_buf.data, bytes);
  return Status::Ok();
}

void Endpoint::set_slowdown(double factor) {
  impl_->slowdown = factor >= 1 ? factor : 1;
}

Result<double> Endpoint::Impl::PingPong(uint64_t peer, bool initiator, size_t bytes, int iterations) {
  MS_RETURN_IF_ERROR(Reserve(send_buf, bytes));
  MS_RETURN_IF_ERROR(Reserve(recv_buf, bytes));
  const int total = kWarmupRoundTrips + iterations;
  double started = 0;
  double deadline = NowSeconds() + kStallTimeoutS;
  // Each side's receive is posted before its own send, so the peer's message finds it waiting.
  MS_RETURN_IF_ERROR(Post(recv_op, true, recv_buf.data, bytes, recv_buf.desc(), peer, deadline));
  for (int i = 0; i < total; ++i) {
    if (i == kWarmupRoundTrips) started = NowSeconds();
    deadline = NowSeconds() + kStallTimeoutS;
    if (initiator) MS_RETURN_IF_ERROR(SendBuffered(bytes, peer, deadline));
    MS_RETURN_IF_ERROR(Wait(recv_op, deadline));
    MS_RETURN_IF_ERROR(CheckLength(recv_op, bytes));
    if (i + 1 < total) MS_RETURN_IF_ERROR(Post(recv_op, true, recv_buf.data, bytes, recv_buf.desc(), peer, deadline));
    if (!initiator) MS_RETURN_IF_ERROR(SendBuffered(bytes, peer, deadline));
  }
  return (NowSeconds() - started) / iterations / 2;
}

Result<double> Endpoint::Impl::StreamSend(uint64_t peer, size_t bytes, int count) {
  MS_RETURN_IF_ERROR(Reserve(send_buf, bytes));
  MS_RETURN_IF_ERROR(Reserve(recv_buf, kAckBytes));
  double deadline = NowSeconds() + kStallTimeoutS;
  MS_RETURN_IF_ERROR(Post(recv_op, true, recv_buf.data, kAckBytes, recv_buf.desc(), peer, deadline));
  // A slowed endpoint (set_slowdown) streams one message at a time: each send's own duration is
  // then its post to its completion, and its wait overlaps no other transfer (with sends in flight
  // during the wait, the peer would catch up and hide the slowdown).
  const int window = slowdown > 1 ? 1 : kStreamWindow;
  double started = NowSeconds();
  // A send's duration: from its post, or from the end of the previous one's wait when later.
  double resumed = started;
  int posted = 0, completed = 0;
  while (completed < count) {
    for (Op& op : stream_ops) {
      if (posted == count || posted - completed >= window) break;
      if (op.busy) continue;
      MS_RETURN_IF_ERROR(Post(op, false, send_buf.data, bytes, send_buf.desc(), peer, deadline));
      ++posted;
    }
    Status s = Progress();
    if (!s.ok()) {
      MarkBroken(fmt::format("reading completions failed: {}", s.message()));
      return s;
    }
    bool any = false;
    for (Op& op : stream_ops) {
      if (!op.busy || !op.done) continue;
      op.busy = false;
      MS_RETURN_IF_ERROR(op.status);
      ++completed;
      any = true;
      SlowDown(op.completed_at - std::max(op.posted_at, resumed));
      resumed = NowSeconds();
    }
    if (any) deadline = NowSeconds() + kStallTimeoutS;
    if (!any && NowSeconds() > deadline) return TimedOut("a streamed send", deadline, deadline - kStallTimeoutS);
  }
  MS_RETURN_IF_ERROR(Wait(recv_op, deadline));
  MS_RETURN_IF_ERROR(CheckLength(recv_op, kAckBytes));
  double seconds = NowSeconds() - started;
  return static_cast<double>(bytes) * count / seconds;
}

Result<double> Endpoint::Impl::StreamRecv(uint64_t peer, size_t bytes, int count) {
  // Each posted receive has its own slot of a ring, as many as fit in kStreamRecvRingBytes.
  size_t window = std::clamp<size_t>(kStreamRecvRingBytes / bytes, 1, kStreamWindow);
  window = std::min(window, static_cast<size_t>(count));
  MS_RETURN_IF_ERROR(Reserve(recv_buf, window * bytes));
  MS_RETURN_IF_ERROR(Reserve(send_buf, kAckBytes));
  double deadline = NowSeconds() + kStallTimeoutS;
  int posted = 0, received = 0;
  for (size_t i = 0; i < window; ++i, ++posted) {
    MS_RETURN_IF_ERROR(Post(stream_ops[i], true, recv_buf.data + i * bytes, bytes, recv_buf.desc(), peer, deadline));
  }
  while (received < count) {
    Status s = Progress();
    if (!s.ok()) {
      MarkBroken(fmt::format("reading completions failed: {}", s.message()));
      return s;
    }
    bool any = false;
    for (size_t i = 0; i < window; ++i) {
      Op& op = stream_ops[i];
      if (!op.busy || !op.done) continue;
      op.busy = false;
      MS_RETURN_IF_ERROR(op.status);
      MS_RETURN_IF_ERROR(CheckLength(op, bytes));
      ++received;
      any = true;
      if (posted < count) {
        MS_RETURN_IF_ERROR(Post(op, true, recv_buf.data + i * bytes, bytes, recv_buf.desc(), peer, deadline));
        ++posted;
      }
    }
    if (any) deadline = NowSeconds() + kStallTimeoutS;
    if (!any && NowSeconds() > deadline) return TimedOut("a streamed receive", deadline, deadline - kStallTimeoutS);
  }
  std::memset(send_buf.data, 0, kAckBytes);
  MS_RETURN_IF_ERROR(SendBuffered(kAckBytes, peer, NowSeconds() + kStallTimeoutS));
  return 0.0;
}

Result<double> PingPong(Endpoint& ep, uint64_t peer, bool initiator, size_t bytes, int iterations) {
  Endpoint::Impl& m = *ep.impl_;
  MS_RETURN_IF_ERROR(m.Usable());
  MS_RETURN_IF_ERROR(m.CheckPeer(peer));
  MS_RETURN_IF_ERROR(m.CheckSize(bytes));
  if (iterations < 1)
    return InvalidArgument("libfabric {}: PingPong needs iterations >= 1, not {}", m.provider, iterations);
  Result<double> r = m.PingPong(peer, initiator, bytes, iterations);
  if (!r.ok() && m.AnyBusy())
    m.MarkBroken(fmt::format("a PingPong failed with operations in flight ({})", r.status().message()));
  return r;
}

Result<double> Stream(Endpoint& ep, uint64_t peer, bool sender, size_t bytes, int count) {
  Endpoint::Impl& m = *ep.impl_;
  MS_RETURN_IF_ERROR(m.Usable());
  MS_RETURN_IF_ERROR(m.CheckPeer(peer));
  MS_RETURN_IF_ERROR(m.CheckSize(bytes));
  if (bytes == 0 || count < 1) {
    return InvalidArgument("libfabric {}: Stream needs bytes >= 1 and count >= 1, not {} and {}", m.provider, bytes,
                           count);
  }
  Result<double> r = sender ? m.StreamSend(peer, bytes, count) : m.StreamRecv(peer, bytes, count);
  if (!r.ok() && m.AnyBusy())
    m.MarkBroken(fmt::format("a Stream failed with operations in flight ({})", r.status().message()));
  return r;
}

}  // namespace ms::fabric
