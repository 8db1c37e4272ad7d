#include <doctest/doctest.h>

#include <vector>

#include "comm/comm.h"

namespace ms::comm {

TEST_CASE("self communicator is the identity and rejects peers") {
  auto c = MakeSelfCommunicator();
  CHECK(c->rank() == 0);
  CHECK(c->size() == 1);
  std::vector<float> a{1, 2, 3}, b(3, 0);
  CHECK(c->AllReduce(a.data(), 3, ReduceOp::kSum)->Wait().ok());
  CHECK(a == std::vector<float>{1, 2, 3});
  CHECK(c->AllGather(a.data(), b.data(), 3)->Wait().ok());
  CHECK(b == a);
  std::fill(b.begin(), b.end(), 0.f);
  CHECK(c->ReduceScatter(a.data(), b.data(), 3)->Wait().ok());
  CHECK(b == a);
  CHECK(c->Broadcast(a.data(), 3, 0)->Wait().ok());
  CHECK_FALSE(c->Broadcast(a.data(), 3, 1)->Wait().ok());
  CHECK_FALSE(c->Send(a.data(), 3, 1, 0)->Wait().ok());
  CHECK_FALSE(c->Recv(a.data(), 3, 1, 0)->Wait().ok());
  CHECK(c->Barrier().ok());
  CHECK(c->name() == "self");
  std::vector<double> d{1.5, -2};
  CHECK(c->AllReduce(d.data(), 2, ReduceOp::kMin)->Wait().ok());
  CHECK(d == std::vector<double>{1.5, -2});
  std::vector<int64_t> k{int64_t{1} << 50};
  CHECK(c->AllReduce(k.data(), 1, ReduceOp::kSum)->Wait().ok());
  CHECK(k[0] == int64_t{1} << 50);
  CHECK(ReduceOpName(ReduceOp::kMin) == "min");
  std::vector<uint16_t> h{0x3F80, 0xFFFF, 1}, g(3, 0);
  CHECK(c->AllGather16(h.data(), g.data(), 3)->Wait().ok());
  CHECK(g == h);
  std::vector<uint16_t> s16{0x3F80, 0xC000, 7}, o16(3, 0);
  CHECK(c->AllReduce16(s16.data(), 3)->Wait().ok());
  CHECK(s16 == std::vector<uint16_t>{0x3F80, 0xC000, 7});
  CHECK(c->ReduceScatter16(s16.data(), o16.data(), 3)->Wait().ok());
  CHECK(o16 == s16);
}

}  // namespace ms::comm
