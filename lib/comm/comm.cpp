// defines: CompletedWork, ReduceOpName, the default Communicator::AllReduce overloads for double and int64, GroupP2p.
#include "comm/comm.h"

namespace ms::comm {
namespace {

class DoneWork : public Work {
 public:
  explicit DoneWork(Status s) : status_(std::move(s)) {}
  Status Wait() override { return status_; }

 private:
  Status status_;
};

class AllWork : public Work {
 public:
  explicit AllWork(std::vector<std::unique_ptr<Work>> works) : works_(std::move(works)) {}
  Status Wait() override {
    Status first = Status::Ok();
    for (auto& w : works_) {
      Status s = w->Wait();
      if (first.ok() && !s.ok()) first = std::move(s);
    }
    return first;
  }

 private:
  std::vector<std::unique_ptr<Work>> works_;
};

}  // namespace

std::unique_ptr<Work> CompletedWork(Status s) {
  return std::make_unique<DoneWork>(std::move(s));
}

std::unique_ptr<Work> Communicator::GroupP2p(const std::vector<P2pOp>& ops) {
  std::vector<std::unique_ptr<Work>> works;
  for (const P2pOp& o : ops) {
    works.push_back(o.send ? Send(o.data, o.count, o.peer, o.tag) : Recv(o.data, o.count, o.peer, o.tag));
  }
  return std::make_unique<AllWork>(std::move(works));
}

std::string_view ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return "sum";
    case ReduceOp::kMax:
      return "max";
    case ReduceOp::kMin:
      return "min";
  }
  return "?";
}

std::unique_ptr<Work> Communicator::AllReduce(double*, int64_t, ReduceOp) {
  return CompletedWork(Unimplemented("{}: all-reduce on doubles is not implemented", name()));
}

std::unique_ptr<Work> Communicator::AllReduce(int64_t*, int64_t, ReduceOp) {
  return CompletedWork(Unimplemented("{}: all-reduce on int64 is not implemented", name()));
}

}  // namespace ms::comm
