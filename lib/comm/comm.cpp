// defines: ReduceOpName, the default Communicator::AllReduce overloads for double and int64.
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

}  // namespace

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
  return std::make_unique<DoneWork>(Unimplemented("{}: all-reduce on doubles is not implemented", name()));
}

std::unique_ptr<Work> Communicator::AllReduce(int64_t*, int64_t, ReduceOp) {
  return std::make_unique<DoneWork>(Unimplemented("{}: all-reduce on int64 is not implemented", name()));
}

}  // namespace ms::comm
