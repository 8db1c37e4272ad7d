#include <doctest/doctest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "device/device.h"

namespace ms::device {

TEST_CASE("cpu device allocates, copies and frees") {
  auto dev = MakeCpuDevice();
  CHECK(dev->is_host());
  auto buf = Buffer::Allocate(dev.get(), 1001);
  REQUIRE(buf.ok());
  CHECK(reinterpret_cast<uintptr_t>(buf->data()) % 64 == 0);
  CHECK(dev->bytes_in_use() >= 1001 * 4);
  for (size_t i = 0; i < buf->count(); ++i) CHECK(buf->f32()[i] == 0.0f);  // zeroed
  std::vector<float> host(1001);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i) * 0.5f;
  REQUIRE(dev->CopyHostToDevice(buf->data(), host.data(), buf->bytes()).ok());
  std::vector<float> back(1001, -1);
  REQUIRE(dev->CopyDeviceToHost(back.data(), buf->data(), buf->bytes()).ok());
  CHECK(back == host);
  CHECK_FALSE(dev->CopyHostToDevice(nullptr, host.data(), 4).ok());
  {
    Buffer moved = std::move(*buf);
    CHECK(moved.count() == 1001);
  }
  CHECK(dev->bytes_in_use() == 0);
}

TEST_CASE("streams run work in order and events order streams") {
  auto dev = MakeCpuDevice();
  auto s1 = dev->CreateStream();
  auto s2 = dev->CreateStream();
  std::vector<int> order;
  std::mutex mu;
  std::atomic<bool> release{false};
  s1->Enqueue([&] {
    while (!release.load()) std::this_thread::yield();
    std::lock_guard<std::mutex> l(mu);
    order.push_back(1);
  });
  auto ev = dev->RecordEvent(*s1);
  CHECK_FALSE(ev->Query());
  s2->WaitEvent(ev);
  s2->Enqueue([&] {
    std::lock_guard<std::mutex> l(mu);
    order.push_back(2);
  });
  release = true;
  s2->Synchronize();
  CHECK(ev->Query());
  REQUIRE(order.size() == 2);
  CHECK(order[0] == 1);
  CHECK(order[1] == 2);
  s1->Synchronize();
}

}  // namespace ms::device
