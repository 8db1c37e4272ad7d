// The Redis Store (hiredis 0.14, blocking contexts) and redis:// URL handling.
//
// Wait() does not poll: every Set()/CompareAndSet() also appends to a one-entry stream
// "<key>\x1fn", and Wait() blocks in XREAD on the streams of the missing keys (ID 0-0, so an
// entry written before the XREAD is seen at once). A waiter costs one command per wake-up.
#include <hiredis/hiredis.h>
#include <sys/time.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <thread>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {
namespace {

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyDeleter>;

constexpr std::string_view kNotifySuffix = "\x1fn";

timeval ToTimeval(Millis ms) {
  timeval tv;
  tv.tv_sec = ms.count() / 1000;
  tv.tv_usec = (ms.count() % 1000) * 1000;
  return tv;
}

int DecimalDigits(size_t n) {
  int d = 1;
  while (n >= 10) {
    n /= 10;
    ++d;
  }
  return d;
}

// Size of a command in RESP: *N\r\n then $len\r\n<arg>\r\n per argument.
int64_t RespCommandBytes(const std::vector<std::string_view>& args) {
  int64_t n = 3 + DecimalDigits(args.size());
  for (auto a : args) n += 1 + DecimalDigits(a.size()) + 2 + static_cast<int64_t>(a.size()) + 2;
  return n;
}

int64_t RespReplyBytes(const redisReply* r) {
  if (!r) return 0;
  switch (r->type) {
    case REDIS_REPLY_STRING:
      return 1 + DecimalDigits(r->len) + 2 + static_cast<int64_t>(r->len) + 2;
    case REDIS_REPLY_STATUS:
    case REDIS_REPLY_ERROR:
      return 1 + static_cast<int64_t>(r->len) + 2;
    case REDIS_REPLY_INTEGER:
      return 1 + fmt::formatted_size("{}", r->integer) + 2;
    case REDIS_REPLY_NIL:
      return 5;
    case REDIS_REPLY_ARRAY: {
      int64_t n = 1 + DecimalDigits(r->elements) + 2;
      for (size_t i = 0; i < r->elements; ++i) n += RespReplyBytes(r->element[i]);
      return n;
    }
    default:
      return 0;
  }
}

bool ParseInt(std::string_view s, int* out) {
  if (s.empty()) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size();
}

// Glob-escapes a literal for SCAN MATCH.
std::string GlobEscape(std::string_view s) {
  std::string out;
  for (char ch : s) {
    if (ch == '*' || ch == '?' || ch == '[' || ch == ']' || ch == '\\') out.push_back('\\');
    out.push_back(ch);
  }
  return out;
}

constexpr const char* kCasScript =
    "local v = redis.call('GET', KEYS[1])\n"
    "local match\n"
    "if ARGV[1] == '1' then match = (v == false) else match = (v == ARGV[2]) end\n"
    "if match then\n"
    "  redis.call('SET', KEYS[1], ARGV[3])\n"
    "  redis.call('XADD', KEYS[2], 'MAXLEN', '1', '*', 'v', ARGV[3])\n"
    "  return {1, ARGV[3]}\n"
    "end\n"
    "if v == false then return {0} end\n"
    "return {0, v}\n";

class RedisStore final : public Store {
 public:
  RedisStore(RedisEndpoint ep, StoreOptions opt) : ep_(std::move(ep)), opt_(std::move(opt)) {
    ns_ = fmt::format("{}/{}/", opt_.job_id, opt_.attempt);
  }
  ~RedisStore() override { Close(); }

  Status Connect() {
    Close();
    Millis backoff = opt_.retry_backoff;
    std::string last;
    const int tries = std::max(1, opt_.connect_retries + 1);
    for (int attempt = 0; attempt < tries; ++attempt) {
      if (attempt > 0) {
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, Millis(2000));
      }
      redisContext* c = redisConnectWithTimeout(ep_.host.c_str(), ep_.port, ToTimeval(opt_.connect_timeout));
      if (c == nullptr) return Internal("redis {}: cannot allocate a hiredis context", Addr());
      if (c->err) {
        last = c->errstr;
        redisFree(c);
        continue;
      }
      c_ = c;
      if (redisSetTimeout(c_, ToTimeval(opt_.op_timeout)) != REDIS_OK) {
        Status s = IoError("redis {}: setting the socket timeout failed: {}", Addr(), c_->errstr);
        Close();
        return s;
      }
      Status s = Handshake();
      if (s.ok()) return s;
      Close();
      if (s.code() == Code::kFailedPrecondition || s.code() == Code::kInvalidArgument) return s;
      last = s.message();
    }
    return Unavailable(
        "cannot connect to redis at {} after {} tries ({}); is redis-server running there and reachable?", Addr(),
        tries, last);
  }

  Status Set(std::string_view key, std::string_view value) override {
    std::string k = Full(key), n = k + std::string(kNotifySuffix);
    MS_ASSIGN_OR_RETURN(auto replies, Exec({{"SET", k, value}, {"XADD", n, "MAXLEN", "1", "*", "v", value}}, "SET"));
    for (auto& r : replies) MS_RETURN_IF_ERROR(CheckNotError(r.get(), "SET", key));
    return Status::Ok();
  }

  Result<std::string> Get(std::string_view key) override {
    std::string k = Full(key);
    MS_ASSIGN_OR_RETURN(auto replies, Exec({{"GET", k}}, "GET"));
    redisReply* r = replies[0].get();
    MS_RETURN_IF_ERROR(CheckNotError(r, "GET", key));
    if (r->type == REDIS_REPLY_NIL) return NotFound("key '{}' not found in {}", key, Describe());
    if (r->type != REDIS_REPLY_STRING)
      return Internal("redis {}: GET {}: unexpected reply type {}", Addr(), key, r->type);
    return std::string(r->str, r->len);
  }

  Result<std::vector<std::optional<std::string>>> MultiGet(const std::vector<std::string>& keys) override {
    std::vector<std::optional<std::string>> out;
    if (keys.empty()) return out;
    std::vector<std::string> full;
    full.reserve(keys.size());
    for (auto& k : keys) full.push_back(Full(k));
    std::vector<std::string_view> cmd{"MGET"};
    for (auto& k : full) cmd.push_back(k);
    MS_ASSIGN_OR_RETURN(auto replies, Exec({cmd}, "MGET"));
    redisReply* r = replies[0].get();
    MS_RETURN_IF_ERROR(CheckNotError(r, "MGET", keys[0]));
    if (r->type != REDIS_REPLY_ARRAY || r->elements != keys.size()) {
      return Internal("redis {}: MGET of {} keys: unexpected reply", Addr(), keys.size());
    }
    out.reserve(keys.size());
    for (size_t i = 0; i < r->elements; ++i) {
      redisReply* e = r->element[i];
      if (e->type == REDIS_REPLY_STRING) {
        out.emplace_back(std::string(e->str, e->len));
      } else {
        out.emplace_back(std::nullopt);
      }
    }
    return out;
  }

  Status Wait(const std::vector<std::string>& keys, Millis timeout) override {
    return WaitImpl(keys, timeout, nullptr);
  }

  Result<std::vector<std::string>> WaitGet(const std::vector<std::string>& keys, Millis timeout) override {
    std::vector<std::string> values(keys.size());
    MS_RETURN_IF_ERROR(WaitImpl(keys, timeout, &values));
    return values;
  }

  // XREAD on the notification streams of the missing keys; each stream's one entry carries the
  // key's latest value, which is returned through `values` (when given).
  Status WaitImpl(const std::vector<std::string>& keys, Millis timeout, std::vector<std::string>* values) {
    std::vector<std::string> pending;
    for (auto& k : keys) pending.push_back(Full(k) + std::string(kNotifySuffix));
    const double deadline = NowSeconds() + timeout.count() / 1000.0;
    while (!pending.empty()) {
      const int64_t remaining_ms = static_cast<int64_t>((deadline - NowSeconds()) * 1000.0);
      if (remaining_ms <= 0) return WaitTimeout(pending, timeout);
      std::string block = std::to_string(remaining_ms);
      std::vector<std::string_view> cmd{"XREAD", "BLOCK", block, "STREAMS"};
      for (auto& p : pending) cmd.push_back(p);
      for (size_t i = 0; i < pending.size(); ++i) cmd.push_back("0-0");
      // The socket must outlive the server-side block by a margin; a silent server still times out.
      MS_ASSIGN_OR_RETURN(auto replies, Exec({cmd}, "XREAD", Millis(remaining_ms + 1000)));
      redisReply* r = replies[0].get();
      MS_RETURN_IF_ERROR(CheckNotError(r, "XREAD", keys[0]));
      if (r->type == REDIS_REPLY_NIL) return WaitTimeout(pending, timeout);
      if (r->type != REDIS_REPLY_ARRAY) return Internal("redis {}: XREAD: unexpected reply type {}", Addr(), r->type);
      for (size_t i = 0; i < r->elements; ++i) {
        redisReply* s = r->element[i];
        if (s->type != REDIS_REPLY_ARRAY || s->elements < 1 || s->element[0]->type != REDIS_REPLY_STRING) continue;
        std::string_view name(s->element[0]->str, s->element[0]->len);
        std::erase_if(pending, [&](const std::string& p) { return p == name; });
        if (values) {
          // [name, [[id, [field, value]], ...]]: the last entry is the latest value.
          const redisReply* entries = s->elements > 1 ? s->element[1] : nullptr;
          if (!entries || entries->type != REDIS_REPLY_ARRAY || entries->elements == 0) continue;
          const redisReply* e = entries->element[entries->elements - 1];
          if (e->type != REDIS_REPLY_ARRAY || e->elements < 2 || e->element[1]->type != REDIS_REPLY_ARRAY ||
              e->element[1]->elements < 2 || e->element[1]->element[1]->type != REDIS_REPLY_STRING) {
            return Internal("redis {}: XREAD: malformed notification entry", Addr());
          }
          const redisReply* v = e->element[1]->element[1];
          for (size_t k = 0; k < keys.size(); ++k) {
            if (name.size() == ns_.size() + keys[k].size() + kNotifySuffix.size() &&
                name.substr(ns_.size(), keys[k].size()) == keys[k]) {
              (*values)[k].assign(v->str, v->len);
            }
          }
        }
      }
    }
    return Status::Ok();
  }

  Result<int64_t> Add(std::string_view key, int64_t delta) override {
    std::string k = Full(key), d = std::to_string(delta);
    MS_ASSIGN_OR_RETURN(auto replies, Exec({{"INCRBY", k, d}}, "INCRBY", std::nullopt, /*idempotent=*/false));
    redisReply* r = replies[0].get();
    MS_RETURN_IF_ERROR(CheckNotError(r, "INCRBY", key));
    if (r->type != REDIS_REPLY_INTEGER) return Internal("redis {}: INCRBY {}: unexpected reply", Addr(), key);
    return static_cast<int64_t>(r->integer);
  }

  Result<CasResult> CompareAndSet(std::string_view key, const std::optional<std::string>& expected,
                                  std::string_view desired) override {
    std::string k = Full(key), n = k + std::string(kNotifySuffix);
    std::string_view absent = expected ? "0" : "1";
    std::string_view exp = expected ? std::string_view(*expected) : std::string_view();
    MS_ASSIGN_OR_RETURN(auto replies,
                        Exec({{"EVAL", kCasScript, "2", k, n, absent, exp, desired}}, "EVAL(cas)", std::nullopt,
                             /*idempotent=*/false));
    redisReply* r = replies[0].get();
    MS_RETURN_IF_ERROR(CheckNotError(r, "compare-and-set", key));
    if (r->type != REDIS_REPLY_ARRAY || r->elements < 1 || r->element[0]->type != REDIS_REPLY_INTEGER) {
      return Internal("redis {}: compare-and-set {}: unexpected reply", Addr(), key);
    }
    CasResult out;
    out.swapped = r->element[0]->integer == 1;
    if (r->elements > 1 && r->element[1]->type == REDIS_REPLY_STRING) {
      out.current = std::string(r->element[1]->str, r->element[1]->len);
    }
    return out;
  }

  Result<int64_t> DeletePrefix(std::string_view prefix) override {
    std::string pattern = GlobEscape(Full(prefix)) + "*";
    std::string cursor = "0";
    int64_t deleted = 0;
    do {
      MS_ASSIGN_OR_RETURN(auto replies, Exec({{"SCAN", cursor, "MATCH", pattern, "COUNT", "1000"}}, "SCAN"));
      redisReply* r = replies[0].get();
      MS_RETURN_IF_ERROR(CheckNotError(r, "SCAN", prefix));
      if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 || r->element[0]->type != REDIS_REPLY_STRING ||
          r->element[1]->type != REDIS_REPLY_ARRAY) {
        return Internal("redis {}: SCAN: unexpected reply", Addr());
      }
      cursor.assign(r->element[0]->str, r->element[0]->len);
      redisReply* keys = r->element[1];
      if (keys->elements > 0) {
        std::vector<std::string_view> cmd{"UNLINK"};
        for (size_t i = 0; i < keys->elements; ++i) {
          std::string_view k(keys->element[i]->str, keys->element[i]->len);
          cmd.push_back(k);
          if (!k.ends_with(kNotifySuffix)) ++deleted;
        }
        MS_ASSIGN_OR_RETURN(auto del, Exec({cmd}, "UNLINK"));
        MS_RETURN_IF_ERROR(CheckNotError(del[0].get(), "UNLINK", prefix));
      }
    } while (cursor != "0");
    return deleted;
  }

  Result<std::string> ServerId() override {
    MS_ASSIGN_OR_RETURN(auto replies, Exec({{"INFO", "server"}}, "INFO"));
    redisReply* r = replies[0].get();
    MS_RETURN_IF_ERROR(CheckNotError(r, "INFO", "server"));
    if (r->type != REDIS_REPLY_STRING) {
      return Internal("redis {}: INFO: unexpected reply type {}", Addr(), r->type);
    }
    std::string_view info(r->str, r->len);
    const size_t at = info.find("run_id:");
    if (at == std::string_view::npos) return Internal("redis {}: INFO server has no run_id", Addr());
    std::string_view id = info.substr(at + 7);
    return std::string(id.substr(0, id.find_first_of("\r\n")));
  }

  Result<std::unique_ptr<Store>> Clone() const override {
    auto s = std::make_unique<RedisStore>(ep_, opt_);
    MS_RETURN_IF_ERROR(s->Connect());
    return std::unique_ptr<Store>(std::move(s));
  }

  StoreStats stats() const override { return stats_; }

  std::string Describe() const override {
    return fmt::format("redis://{}{}:{}/{} ns={}", ep_.user.empty() ? "" : ep_.user + "@", ep_.host, ep_.port, ep_.db,
                       ns_);
  }

 private:
  std::string Addr() const { return fmt::format("{}:{}", ep_.host, ep_.port); }
  std::string Full(std::string_view key) const { return ns_ + std::string(key); }

  void Close() {
    if (c_) redisFree(c_);
    c_ = nullptr;
  }

  Status Handshake() {
    if (!ep_.password.empty()) {
      // AUTH password (the default user), or AUTH user password (a Redis 6+ ACL user).
      std::vector<std::string_view> auth{"AUTH"};
      if (!ep_.user.empty()) auth.push_back(ep_.user);
      auth.push_back(ep_.password);
      MS_ASSIGN_OR_RETURN(auto replies, ExecOnce({auth}, "AUTH", std::nullopt));
      redisReply* r = replies[0].get();
      if (r->type == REDIS_REPLY_ERROR) {
        return FailedPrecondition(
            "redis at {} refused authentication{} ({}); check the password (MEGASCALE_REDIS_PASSWORD or "
            "runtime.redis_password_file)",
            Addr(), ep_.user.empty() ? "" : fmt::format(" of user '{}'", ep_.user), std::string_view(r->str, r->len));
      }
    }
    if (!ep_.password.empty()) return SelectDb();  // a successful AUTH proves the connection
    MS_ASSIGN_OR_RETURN(auto replies, ExecOnce({{"PING"}}, "PING", std::nullopt));
    redisReply* r = replies[0].get();
    if (r->type == REDIS_REPLY_ERROR) {
      std::string_view msg(r->str, r->len);
      if (msg.starts_with("NOAUTH")) {
        return FailedPrecondition(
            "redis at {} requires a password ({}); give it in the URL (redis://:PASSWORD@host:port) or in "
            "MEGASCALE_REDIS_PASSWORD",
            Addr(), msg);
      }
      return Unavailable("redis at {} answered PING with an error: {}", Addr(), msg);
    }
    return SelectDb();
  }

  Status SelectDb() {
    if (ep_.db != 0) {
      std::string db = std::to_string(ep_.db);
      MS_ASSIGN_OR_RETURN(auto sel, ExecOnce({{"SELECT", db}}, "SELECT", std::nullopt));
      if (sel[0]->type == REDIS_REPLY_ERROR) {
        return InvalidArgument("redis at {}: SELECT {} failed: {}", Addr(), ep_.db, sel[0]->str);
      }
    }
    return Status::Ok();
  }

  Status CheckNotError(const redisReply* r, std::string_view what, std::string_view key) const {
    if (r->type == REDIS_REPLY_ERROR) {
      return Internal("redis {}: {} '{}' failed: {}", Addr(), what, key, std::string_view(r->str, r->len));
    }
    return Status::Ok();
  }

  Status WaitTimeout(const std::vector<std::string>& pending, Millis timeout) const {
    std::string names;
    for (size_t i = 0; i < pending.size() && i < 5; ++i) {
      std::string_view p = pending[i];
      p.remove_prefix(ns_.size());
      p.remove_suffix(kNotifySuffix.size());
      names += fmt::format("{}'{}'", i ? ", " : "", p);
    }
    if (pending.size() > 5) names += fmt::format(" and {} more", pending.size() - 5);
    return Timeout("waited {} ms on redis {} (ns {}) for {} key(s) that never appeared: {}", timeout.count(), Addr(),
                   ns_, pending.size(), names);
  }

  // Sends the commands pipelined and reads one reply each. On a transport error the connection
  // is dropped and the error names the server. A connection lost on an idempotent command (all
  // but INCRBY and compare-and-set) is re-established and the command sent once more, so that a
  // restarted server (same address, same password) is transparent to its clients.
  Result<std::vector<ReplyPtr>> Exec(const std::vector<std::vector<std::string_view>>& cmds, std::string_view what,
                                     std::optional<Millis> socket_timeout = std::nullopt, bool idempotent = true) {
    const bool was_connected = c_ != nullptr;
    auto r = ExecOnce(cmds, what, socket_timeout);
    if (!r.ok() && idempotent && was_connected && r.status().code() == Code::kUnavailable) {
      LogWarn("redis {}: {}; reconnecting and sending {} again", Addr(), r.status().message(), what);
      return ExecOnce(cmds, what, socket_timeout);
    }
    return r;
  }

  Result<std::vector<ReplyPtr>> ExecOnce(const std::vector<std::vector<std::string_view>>& cmds, std::string_view what,
                                         std::optional<Millis> socket_timeout) {
    if (!c_) {
      Status s = Connect();
      if (!s.ok()) return s.WithContext(fmt::format("reconnecting for {}", what));
    }
    if (socket_timeout && redisSetTimeout(c_, ToTimeval(*socket_timeout)) != REDIS_OK) {
      return IoError("redis {}: setting the socket timeout failed", Addr());
    }
    std::vector<const char*> argv;
    std::vector<size_t> argvlen;
    for (auto& cmd : cmds) {
      argv.clear();
      argvlen.clear();
      for (auto a : cmd) {
        argv.push_back(a.data());
        argvlen.push_back(a.size());
      }
      if (redisAppendCommandArgv(c_, static_cast<int>(argv.size()), argv.data(), argvlen.data()) != REDIS_OK) {
        Status s = TransportError(what);
        Close();
        return s;
      }
      ++stats_.ops;
      stats_.bytes_sent += RespCommandBytes(cmd);
    }
    std::vector<ReplyPtr> replies;
    for (size_t i = 0; i < cmds.size(); ++i) {
      void* raw = nullptr;
      if (redisGetReply(c_, &raw) != REDIS_OK || raw == nullptr) {
        Status s = TransportError(what);
        Close();
        return s;
      }
      replies.emplace_back(static_cast<redisReply*>(raw));
      stats_.bytes_received += RespReplyBytes(replies.back().get());
    }
    if (socket_timeout && redisSetTimeout(c_, ToTimeval(opt_.op_timeout)) != REDIS_OK) {
      return IoError("redis {}: restoring the socket timeout failed", Addr());
    }
    return replies;
  }

  Status TransportError(std::string_view what) const {
    const int err = c_->err;
    std::string msg = c_->errstr;
    if (err == REDIS_ERR_IO && (msg.find("temporarily unavailable") != std::string::npos || errno == EAGAIN)) {
      return Timeout("redis {}: {} got no answer within the timeout ({}); is the server overloaded or stopped?", Addr(),
                     what, msg);
    }
    return Unavailable("redis {}: connection lost during {}: {}", Addr(), what, msg.empty() ? "unknown error" : msg);
  }

  RedisEndpoint ep_;
  StoreOptions opt_;
  std::string ns_;
  redisContext* c_ = nullptr;
  StoreStats stats_;
};

}  // namespace

std::string RedactUrl(std::string_view url) {
  size_t scheme = url.find("://");
  size_t start = scheme == std::string_view::npos ? 0 : scheme + 3;
  // The userinfo ends at the last '@' (a password may contain '@' or '/').
  size_t at = url.rfind('@');
  if (at == std::string_view::npos || at < start) return std::string(url);
  std::string_view userinfo = url.substr(start, at - start);
  size_t colon = userinfo.find(':');
  std::string user = colon == std::string_view::npos ? "" : std::string(userinfo.substr(0, colon));
  return fmt::format("{}{}:***@{}", url.substr(0, start), user, url.substr(at + 1));
}

Result<RedisEndpoint> ParseRedisUrl(std::string_view url) {
  constexpr std::string_view kScheme = "redis://";
  auto bad = [&](std::string_view why) {
    return InvalidArgument(
        "bad redis address '{}': {} (expected host:port or redis://[user[:password]@]host:port[/db])", RedactUrl(url),
        why);
  };
  std::string_view rest = url;
  if (rest.starts_with(kScheme)) {
    rest.remove_prefix(kScheme.size());
  } else if (rest.find("://") != std::string_view::npos) {
    return bad("the scheme must be redis://");
  }
  RedisEndpoint ep;
  size_t at = rest.rfind('@');
  if (at != std::string_view::npos) {
    if (!url.starts_with(kScheme)) return bad("a user or password needs the redis:// form");
    std::string_view userinfo = rest.substr(0, at);
    size_t colon = userinfo.find(':');
    ep.user = std::string(userinfo.substr(0, colon));
    if (colon != std::string_view::npos) ep.password = std::string(userinfo.substr(colon + 1));
    rest = rest.substr(at + 1);
  }
  size_t slash = rest.find('/');
  std::string_view hostport = rest.substr(0, slash);
  if (slash != std::string_view::npos) {
    std::string_view db = rest.substr(slash + 1);
    if (!db.empty() && (!ParseInt(db, &ep.db) || ep.db < 0)) return bad("the database must be a number >= 0");
  }
  size_t colon = hostport.rfind(':');
  if (colon == std::string_view::npos) {
    ep.host = std::string(hostport);
  } else {
    ep.host = std::string(hostport.substr(0, colon));
    if (!ParseInt(hostport.substr(colon + 1), &ep.port) || ep.port < 1 || ep.port > 65535) {
      return bad("the port must be a number in 1..65535");
    }
  }
  if (ep.host.empty()) return bad("the host is missing");
  return ep;
}

Result<std::unique_ptr<Store>> ConnectRedisStore(const StoreOptions& options) {
  MS_ASSIGN_OR_RETURN(RedisEndpoint ep, ParseRedisUrl(options.url));
  if (ep.password.empty()) ep.password = options.password;
  if (ep.password.empty()) {
    if (auto pw = GetEnv("MEGASCALE_REDIS_PASSWORD")) ep.password = *pw;
  }
  if (!ep.user.empty() && ep.password.empty()) {
    return InvalidArgument("redis user '{}' at {}:{} needs a password (MEGASCALE_REDIS_PASSWORD or a password file)",
                           ep.user, ep.host, ep.port);
  }
  if (options.job_id.empty() || options.job_id.find_first_of(" \t\n/") != std::string::npos) {
    return InvalidArgument("job id '{}' must be non-empty, without spaces or '/'", options.job_id);
  }
  if (options.attempt < 0) return InvalidArgument("attempt must be >= 0, got {}", options.attempt);
  auto store = std::make_unique<RedisStore>(std::move(ep), options);
  MS_RETURN_IF_ERROR(store->Connect());
  return std::unique_ptr<Store>(std::move(store));
}

Status StoreBarrier(Store& store, std::string_view key, int world, Millis timeout) {
  const std::string count_key = fmt::format("{}/count", key), done_key = fmt::format("{}/done", key);
  MS_ASSIGN_OR_RETURN(int64_t n, store.Add(count_key, 1));
  if (n == world) return store.Set(done_key, "1");
  if (n > world) {
    return Internal("barrier '{}' counted {} arrivals for {} ranks: a rank arrived twice", key, n, world);
  }
  MS_RETURN_IF_ERROR_CTX(store.Wait({done_key}, timeout), "barrier '{}' ({} of {} ranks had arrived when this one did)",
                         key, n, world);
  return Status::Ok();
}

}  // namespace ms::bootstrap
