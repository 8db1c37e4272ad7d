#include <doctest/doctest.h>
#include <hiredis/hiredis.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "bootstrap/redis_fixture.h"

namespace ms::bootstrap {
using testing::RedisFixture;

namespace {
std::string PasswordOf(const std::string& url) {
  return ParseRedisUrl(url)->password;
}
bool Alive(pid_t pid) {
  return kill(pid, 0) == 0;
}
}  // namespace

TEST_CASE("redis URLs are parsed and redacted") {
  auto ep = ParseRedisUrl("redis://:s3cret@10.0.0.5:6390/2");
  REQUIRE(ep.ok());
  CHECK(ep->host == "10.0.0.5");
  CHECK(ep->port == 6390);
  CHECK(ep->password == "s3cret");
  CHECK(ep->db == 2);
  auto plain = ParseRedisUrl("redis://localhost:7000");
  REQUIRE(plain.ok());
  CHECK(plain->password.empty());
  CHECK(plain->db == 0);
  CHECK(RedactUrl("redis://:s3cret@h:1/0") == "redis://:***@h:1/0");
  CHECK(RedactUrl("redis://user:p@ss@h:1") == "redis://user:***@h:1");
  CHECK(RedactUrl("redis://h:1") == "redis://h:1");
  for (const char* bad : {"http://:pw@h:1", "redis://:topsecret@h:99999", "redis://:topsecret@:1", "redis://h:1/x"}) {
    auto r = ParseRedisUrl(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == Code::kInvalidArgument);
    CHECK(r.status().message().find("topsecret") == std::string::npos);
  }
}

TEST_CASE("EmbeddedRedis starts on loopback with a password and stops by its PID") {
  RedisFixture fx;
  const pid_t pid = fx.redis->pid();
  const std::string dir = fx.redis->dir();
  CHECK(pid > 0);
  CHECK(Alive(pid));
  CHECK(std::filesystem::exists(dir + "/redis.pid"));
  CHECK(fx.redis->url().find("redis://127.0.0.1:") == 0);  // no password in the URL
  CHECK(PasswordOf(fx.redis->url()).empty());
  CHECK(fx.redis->password().size() == 32);
  // Movable: the moved-to object owns the server.
  EmbeddedRedis moved = std::move(*fx.redis);
  CHECK_FALSE(fx.redis->running());
  CHECK(moved.pid() == pid);
  auto store = ConnectRedisStore([&] {
    StoreOptions so;
    so.url = moved.url();
    so.password = moved.password();
    return so;
  }());
  REQUIRE(store.ok());
  CHECK((*store)->Set("k", "v").ok());
  CHECK(moved.Stop().ok());
  CHECK_FALSE(Alive(pid));
  CHECK_FALSE(std::filesystem::exists(dir));
  CHECK(moved.Stop().ok());  // idempotent
}

TEST_CASE("EmbeddedRedis: a missing redis-server says how to install it") {
  EmbeddedRedisOptions o;
  o.executable = "redis-server-that-does-not-exist";
  auto r = EmbeddedRedis::Start(o);
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kNotFound);
  CHECK(r.status().message().find("scripts/setup.sh") != std::string::npos);
}

TEST_CASE("store semantics: set, get, multi-get, add, compare-and-set, delete-prefix") {
  RedisFixture fx;
  auto s = fx.Connect();
  CHECK(s->Set("a", "1").ok());
  CHECK(s->Set("bin", std::string("x\0y\n", 4)).ok());
  CHECK(*s->Get("a") == "1");
  CHECK(*s->Get("bin") == std::string("x\0y\n", 4));
  auto missing = s->Get("nope");
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == Code::kNotFound);
  auto mg = s->MultiGet({"a", "nope", "bin"});
  REQUIRE(mg.ok());
  REQUIRE(mg->size() == 3);
  CHECK((*mg)[0] == std::optional<std::string>("1"));
  CHECK_FALSE((*mg)[1].has_value());
  CHECK(*s->Add("n", 5) == 5);
  CHECK(*s->Add("n", -2) == 3);
  auto cas1 = s->CompareAndSet("c", std::nullopt, "first");
  REQUIRE(cas1.ok());
  CHECK(cas1->swapped);
  auto cas2 = s->CompareAndSet("c", std::nullopt, "second");
  REQUIRE(cas2.ok());
  CHECK_FALSE(cas2->swapped);
  CHECK(cas2->current == std::optional<std::string>("first"));
  auto cas3 = s->CompareAndSet("c", std::string("first"), "third");
  CHECK(cas3->swapped);
  CHECK(*s->Get("c") == "third");
  CHECK(s->Wait({"c"}, Millis(100)).ok());  // compare-and-set wakes waiters too
  for (int i = 0; i < 30; ++i) CHECK(s->Set(fmt::format("grp/{}", i), "x").ok());
  CHECK(s->Set("grp*", "literal star").ok());
  auto del = s->DeletePrefix("grp/");
  REQUIRE(del.ok());
  CHECK(*del == 30);
  CHECK(s->Get("grp/3").status().code() == Code::kNotFound);
  CHECK(*s->Get("grp*") == "literal star");  // the prefix is literal, not a glob
  CHECK(*s->Get("a") == "1");
  StoreStats st = s->stats();
  CHECK(st.ops > 40);
  CHECK(st.bytes_sent > 0);
  CHECK(st.bytes_received > 0);
  CHECK(s->Describe().find(fx.redis->password()) == std::string::npos);
}

TEST_CASE("namespaces: job id and attempt isolate keys") {
  RedisFixture fx;
  auto a0 = fx.Connect("job", 0);
  auto a1 = fx.Connect("job", 1);
  auto other = fx.Connect("other", 0);
  CHECK(a0->Set("reg/0", "old").ok());
  CHECK(a1->Get("reg/0").status().code() == Code::kNotFound);
  CHECK(other->Get("reg/0").status().code() == Code::kNotFound);
  CHECK(a1->Wait({"reg/0"}, Millis(200)).code() == Code::kTimeout);
  auto clone = a0->Clone();
  REQUIRE(clone.ok());
  CHECK(*(*clone)->Get("reg/0") == "old");
  CHECK((*clone)->stats().ops == 2);  // AUTH, GET
}

TEST_CASE("wait blocks until another connection sets the keys, and times out naming them") {
  RedisFixture fx;
  auto waiter = fx.Connect();
  std::thread setter([&] {
    auto s = fx.Connect();
    std::this_thread::sleep_for(std::chrono::milliseconds(150));
    CHECK(s->Set("x", "1").ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK(s->Set("y", "2").ok());
  });
  double t0 = NowSeconds();
  Status w = waiter->Wait({"x", "y"}, Millis(5000));
  double dt = NowSeconds() - t0;
  setter.join();
  CHECK(w.ok());
  CHECK(dt > 0.2);
  auto values = waiter->WaitGet({"y", "x"}, Millis(100));
  REQUIRE(values.ok());
  CHECK(*values == std::vector<std::string>{"2", "1"});
  CHECK(waiter->Set("x", "updated").ok());
  CHECK((*waiter->WaitGet({"x"}, Millis(100)))[0] == "updated");  // the latest value
  CHECK(waiter->WaitGet({"absent"}, Millis(100)).status().code() == Code::kTimeout);
  CHECK(dt < 2.0);
  t0 = NowSeconds();
  Status to = waiter->Wait({"x", "never", "nor-this"}, Millis(300));
  dt = NowSeconds() - t0;
  CHECK(to.code() == Code::kTimeout);
  CHECK(to.message().find("'never'") != std::string::npos);
  CHECK(to.message().find("'nor-this'") != std::string::npos);
  CHECK(to.message().find("'x'") == std::string::npos);
  CHECK(dt >= 0.29);
  CHECK(dt < 1.5);
  CHECK(*waiter->Get("y") == "2");  // the connection is still usable
}

TEST_CASE("wrong or missing password: a clear error naming the address, never the password") {
  RedisFixture fx;
  const std::string good = fx.redis->password();
  const int port = fx.redis->port();
  StoreOptions so = fx.Options();
  so.password.clear();
  so.url = fmt::format("redis://:wrong-secret@127.0.0.1:{}", port);
  auto bad = ConnectRedisStore(so);
  REQUIRE_FALSE(bad.ok());
  CHECK(bad.status().code() == Code::kFailedPrecondition);
  CHECK(bad.status().message().find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
  CHECK(bad.status().message().find("authentication") != std::string::npos);
  CHECK(bad.status().message().find("wrong-secret") == std::string::npos);
  so.url = fmt::format("redis://127.0.0.1:{}", port);
  unsetenv("MEGASCALE_REDIS_PASSWORD");
  auto none = ConnectRedisStore(so);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message().find("requires a password") != std::string::npos);
  // The password may come from the environment.
  setenv("MEGASCALE_REDIS_PASSWORD", good.c_str(), 1);
  auto env = ConnectRedisStore(so);
  unsetenv("MEGASCALE_REDIS_PASSWORD");
  REQUIRE(env.ok());
  CHECK((*env)->Set("k", "v").ok());
}

TEST_CASE("refused connection: retries with backoff, then names host:port") {
  RedisFixture fx;
  const int port = fx.redis->port();
  REQUIRE(fx.redis->Stop().ok());
  StoreOptions so;
  so.url = fmt::format("redis://:pw@127.0.0.1:{}", port);
  so.connect_retries = 3;
  so.retry_backoff = Millis(50);
  double t0 = NowSeconds();
  auto r = ConnectRedisStore(so);
  double dt = NowSeconds() - t0;
  REQUIRE_FALSE(r.ok());
  CHECK(r.status().code() == Code::kUnavailable);
  CHECK(r.status().message().find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
  CHECK(r.status().message().find("4 tries") != std::string::npos);
  CHECK(dt >= 0.3);  // 50 + 100 + 200 ms of backoff
  CHECK(dt < 3.0);
}

TEST_CASE("redis killed during a wait: the waiter fails at once with an error naming the server") {
  RedisFixture fx;
  auto s = fx.Connect();
  const pid_t pid = fx.redis->pid();
  const int port = fx.redis->port();
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    kill(pid, SIGKILL);
  });
  double t0 = NowSeconds();
  Status w = s->Wait({"never"}, Millis(30000));
  double dt = NowSeconds() - t0;
  killer.join();
  CHECK(w.code() == Code::kUnavailable);
  CHECK(w.message().find(fmt::format("127.0.0.1:{}", port)) != std::string::npos);
  CHECK(dt < 5.0);
  // The next call tries to reconnect and fails clearly, too.
  auto g = s->Get("k");
  CHECK(g.status().code() == Code::kUnavailable);
}

}  // namespace ms::bootstrap

namespace ms::bootstrap {
using testing::RedisFixture;

TEST_CASE("redis addresses: bare host:port, and the user name of an ACL user is kept") {
  auto bare = ParseRedisUrl("redis-host:6380");
  REQUIRE(bare.ok());
  CHECK(bare->host == "redis-host");
  CHECK(bare->port == 6380);
  CHECK(bare->user.empty());
  auto user = ParseRedisUrl("redis://alice@10.0.0.5:6390/1");
  REQUIRE(user.ok());
  CHECK(user->user == "alice");
  CHECK(user->password.empty());
  CHECK(user->db == 1);
  auto both = ParseRedisUrl("redis://alice:pw@h:1");
  REQUIRE(both.ok());
  CHECK(both->user == "alice");
  CHECK(both->password == "pw");
  CHECK_FALSE(ParseRedisUrl("alice@h:1").ok());  // userinfo needs the redis:// form
}

TEST_CASE("an ACL user authenticates with its own name and password") {
  RedisFixture fx;
  auto admin = fx.Connect();
  // ACL SETUSER through a raw connection (the Store has no such command).
  {
    StoreOptions so = fx.Options();
    redisContext* c = redisConnect("127.0.0.1", fx.redis->port());
    REQUIRE(c != nullptr);
    REQUIRE(c->err == 0);
    auto* r = static_cast<redisReply*>(redisCommand(c, "AUTH %s", so.password.c_str()));
    REQUIRE(r != nullptr);
    CHECK(r->type != REDIS_REPLY_ERROR);
    freeReplyObject(r);
    r = static_cast<redisReply*>(redisCommand(c, "ACL SETUSER alice on >alice-secret ~* &* +@all"));
    REQUIRE(r != nullptr);
    CHECK(r->type != REDIS_REPLY_ERROR);
    freeReplyObject(r);
    redisFree(c);
  }
  StoreOptions so = fx.Options();
  so.url = fmt::format("redis://alice@127.0.0.1:{}/0", fx.redis->port());
  so.password = "alice-secret";
  auto alice = ConnectRedisStore(so);
  REQUIRE_MESSAGE(alice.ok(), alice.status().ToString());
  CHECK((*alice)->Set("from-alice", "1").ok());
  CHECK(*admin->Get("from-alice") == "1");
  CHECK((*alice)->Describe().find("alice@") != std::string::npos);
  // The default user's password is not alice's: refused, and the message names the user.
  so.password = fx.Options().password;
  auto wrong = ConnectRedisStore(so);
  REQUIRE_FALSE(wrong.ok());
  CHECK(wrong.status().message().find("user 'alice'") != std::string::npos);
  // A user without any password is a clear error before connecting.
  so.password.clear();
  unsetenv("MEGASCALE_REDIS_PASSWORD");
  auto none = ConnectRedisStore(so);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().code() == Code::kInvalidArgument);
}

TEST_CASE("the embedded redis-server outlives the job's stop signals and stops on request") {
  RedisFixture fx;
  const pid_t pid = fx.redis->pid();
  auto store = fx.Connect();
  for (int sig : {SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2}) {
    REQUIRE(kill(pid, sig) == 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  CHECK_FALSE(fx.redis->PollExit().has_value());
  CHECK(store->Set("still", "here").ok());
  const std::string dir = fx.redis->dir();
  const double t0 = NowSeconds();
  CHECK(fx.redis->Stop().ok());  // SHUTDOWN NOSAVE, not a signal it ignores
  CHECK(NowSeconds() - t0 < 2.0);
  CHECK_FALSE(Alive(pid));
  CHECK_FALSE(std::filesystem::exists(dir));
}

TEST_CASE("a dead embedded redis-server is noticed by its PID and restarted on the same port") {
  RedisFixture fx;
  const int port = fx.redis->port();
  auto store = fx.Connect();
  REQUIRE(store->Set("a", "1").ok());
  REQUIRE(kill(fx.redis->pid(), SIGKILL) == 0);
  std::optional<int> status;
  for (int i = 0; i < 200 && !status; ++i) {
    status = fx.redis->PollExit();
    if (!status) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(status.has_value());
  CHECK(WIFSIGNALED(*status));
  CHECK_FALSE(fx.redis->running());
  REQUIRE(fx.redis->Restart().ok());
  CHECK(fx.redis->running());
  CHECK(fx.redis->port() == port);
  // The old client reconnects by itself (same address and password); the keys are gone.
  auto lost = store->Get("a");
  if (lost.ok() || lost.status().code() == Code::kUnavailable) lost = store->Get("a");
  CHECK(lost.status().code() == Code::kNotFound);
  CHECK(store->Set("b", "2").ok());
}

}  // namespace ms::bootstrap
