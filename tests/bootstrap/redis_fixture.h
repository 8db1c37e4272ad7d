// Test helper: a private redis-server (EmbeddedRedis) and store options pointing at it.
#pragma once

#include <doctest/doctest.h>

#include <string>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap::testing {

struct RedisFixture {
  RedisFixture() {
    EmbeddedRedisOptions o;
    o.max_clients = 2000;
    auto r = EmbeddedRedis::Start(o);
    REQUIRE_MESSAGE(r.ok(), r.status().ToString());
    redis.emplace(std::move(r).value());
  }
  StoreOptions Options(std::string job = "test", int attempt = 0) const {
    StoreOptions so;
    so.url = redis->url();
    so.password = redis->password();
    so.job_id = std::move(job);
    so.attempt = attempt;
    so.op_timeout = Millis(10000);
    so.connect_retries = 1;
    so.retry_backoff = Millis(50);
    return so;
  }
  std::unique_ptr<Store> Connect(std::string job = "test", int attempt = 0) const {
    auto s = ConnectRedisStore(Options(std::move(job), attempt));
    REQUIRE_MESSAGE(s.ok(), s.status().ToString());
    return std::move(s).value();
  }
  std::optional<EmbeddedRedis> redis;
};

}  // namespace ms::bootstrap::testing
