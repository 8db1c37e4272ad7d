// Process groups on the CPU backend: Gloo full-mesh contexts built through our Store.
#include <gloo/allreduce.h>
#include <gloo/common/error.h>
#include <gloo/math.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>

#include <fmt/ranges.h>

#include <algorithm>
#include <exception>
#include <stdexcept>

#include "bootstrap/bootstrap.h"
#include "comm/comm.h"

namespace ms::bootstrap {
namespace {

// Carries a Status through Gloo (which expects its store to throw) back to our boundary.
struct StoreFailure : std::runtime_error {
  explicit StoreFailure(Status s) : std::runtime_error(s.message()), status(std::move(s)) {}
  Status status;
};

// gloo::rendezvous::Store over our Store. get() blocks until the key exists (as Gloo expects).
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(ms::bootstrap::Store& store, Millis timeout) : store_(store), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Check(store_.Set(key, std::string_view(data.data(), data.size())));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.WaitGet({key}, timeout_);
    Check(v.status());
    return std::vector<char>((*v)[0].begin(), (*v)[0].end());
  }
  void wait(const std::vector<std::string>& keys) override { Check(store_.Wait(keys, timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    Check(store_.Wait(keys, std::min(timeout_, Millis(timeout.count()))));
  }

 private:
  static void Check(const Status& s) {
    if (!s.ok()) throw StoreFailure(s);
  }
  ms::bootstrap::Store& store_;
  Millis timeout_;
};

// Runs fn, turning Gloo's exceptions into a Status with context.
template <typename Fn>
Status GlooCall(std::string_view what, Fn&& fn) {
  try {
    fn();
    return Status::Ok();
  } catch (const StoreFailure& e) {
    return e.status.WithContext(what);
  } catch (const gloo::IoException& e) {
    return Unavailable("{}: gloo I/O error: {}", what, e.what());
  } catch (const gloo::Exception& e) {
    return Internal("{}: gloo error: {}", what, e.what());
  } catch (const std::exception& e) {
    return Internal("{}: {}", what, e.what());
  }
}

std::shared_ptr<gloo::Context>& Slot(ProcessGroups& g, GroupKind kind) {
  switch (kind) {
    case GroupKind::kTp:
      return g.tp;
    case GroupKind::kPp:
      return g.pp;
    case GroupKind::kDp:
      return g.dp;
    case GroupKind::kEmbedding:
      return g.embedding;
    case GroupKind::kModelParallel:
      return g.model_parallel;
    case GroupKind::kWorld:
      break;
  }
  return g.world;
}

}  // namespace

std::shared_ptr<gloo::Context> ProcessGroups::Get(GroupKind kind) const {
  return Slot(const_cast<ProcessGroups&>(*this), kind);
}

Result<ProcessGroups> CreateProcessGroups(Store& store, const Topology& topology, const ProcessGroupOptions& options) {
  ProcessGroups groups;
  MS_ASSIGN_OR_RETURN(std::shared_ptr<gloo::transport::Device> device,
                      comm::MakeGlooTcpDevice(options.listen_address, &groups.loop_note));
  GlooStoreAdapter adapter(store, options.timeout);
  const int rank = topology.rank;

  GroupExchangeOptions ex;
  ex.timeout = options.timeout;
  ex.id_bytes = 32;
  ex.baseline = options.baseline;
  ex.on_group = [&](GroupKind kind, int index, const std::vector<int>& members, const std::string& id) -> Status {
    auto pos = std::find(members.begin(), members.end(), rank);
    const int group_rank = static_cast<int>(pos - members.begin());
    const int size = static_cast<int>(members.size());
    groups.members[static_cast<int>(kind)] = members;
    // Gloo's own key exchange lives under the communicator id: a re-created group never sees the
    // addresses of an earlier one.
    const std::string prefix = fmt::format("group/{}/{}/{}", GroupKindName(kind), index, id.empty() ? "solo" : id);
    std::shared_ptr<gloo::rendezvous::Context> ctx;
    MS_RETURN_IF_ERROR(
        GlooCall(fmt::format("Gloo full mesh of {} group {} (size {})", GroupKindName(kind), index, size), [&] {
          ctx = std::make_shared<gloo::rendezvous::Context>(group_rank, size);
          ctx->setTimeout(options.timeout);
          gloo::rendezvous::PrefixStore prefixed(prefix, adapter);
          ctx->connectFullMesh(prefixed, device);
        }));
    Slot(groups, kind) = std::move(ctx);
    return Status::Ok();
  };
  MS_ASSIGN_OR_RETURN(GroupIds ids, ExchangeGroupIds(store, topology.grid, rank, ex));
  groups.phases = std::move(ids.phases);
  return groups;
}

Result<std::vector<std::string>> CheckGroupsAllReduce(const ProcessGroups& groups, const ParallelGrid& grid, int rank,
                                                      Millis timeout) {
  std::vector<std::string> lines;
  for (GroupKind kind : kAllGroupKinds) {
    std::shared_ptr<gloo::Context> ctx = groups.Get(kind);
    const std::vector<int> expected = grid.Group(kind, rank);
    if (!ctx) {
      if (!expected.empty()) return Internal("rank {} has no {} communicator", rank, GroupKindName(kind));
      continue;
    }
    if (ctx->size != static_cast<int>(expected.size())) {
      return InvalidArgument("{} group of rank {}: communicator size {} but the formula says {}", GroupKindName(kind),
                             rank, ctx->size, expected.size());
    }
    // [0, world): one-hot membership; [world]: rank + 1.
    const int world = grid.world();
    std::vector<int64_t> buf(world + 1, 0);
    buf[rank] = 1;
    buf[world] = rank + 1;
    MS_RETURN_IF_ERROR(GlooCall(fmt::format("all-reduce in the {} group of rank {}", GroupKindName(kind), rank), [&] {
      gloo::AllreduceOptions opts(ctx);
      opts.setOutput(buf.data(), buf.size());
      opts.setReduceFunction(static_cast<void (*)(void*, const void*, const void*, size_t)>(&gloo::sum<int64_t>));
      opts.setTag(100 + static_cast<int>(kind));
      opts.setTimeout(timeout);
      gloo::allreduce(opts);
    }));
    std::vector<int> got;
    for (int r = 0; r < world; ++r) {
      if (buf[r] == 1) {
        got.push_back(r);
      } else if (buf[r] != 0) {
        return InvalidArgument("{} group of rank {}: rank {} counted {} times", GroupKindName(kind), rank, r, buf[r]);
      }
    }
    int64_t want_sum = 0;
    for (int r : expected) want_sum += r + 1;
    if (got != expected || buf[world] != want_sum) {
      return InvalidArgument("{} group of rank {}: all-reduce saw members [{}] sum {}, the formula says [{}] sum {}",
                             GroupKindName(kind), rank, fmt::join(got, ","), buf[world], fmt::join(expected, ","),
                             want_sum);
    }
    lines.push_back(fmt::format("{}[{}] members {} sum {} ok", GroupKindName(kind), grid.GroupIndex(kind, rank),
                                fmt::join(got, ","), buf[world]));
  }
  return lines;
}

}  // namespace ms::bootstrap
