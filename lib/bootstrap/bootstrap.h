// megascale bootstrap: the 3D rank grid (pure arithmetic), a key-value Store with a Redis
// implementation, an embedded redis-server for jobs that name none, the rendezvous of ranks
// (one global barrier), creation of the per-group communicators (Gloo on the CPU backend) and
// the `megascale init-test` benchmark that times all of it.
//
// Contract (whole module):
//  - No function throws. Errors are Status/Result with context; Gloo's and hiredis' failures are
//    converted at this module's boundary.
//  - Passwords never appear in a message or log line: every URL in a message is redacted.
//  - A Store is one connection and is NOT thread-safe: use one Store per thread (Clone()).
//  - Every store call is bounded in time: Wait() by its argument, every other call by
//    StoreOptions::op_timeout. A dead Redis gives an Unavailable error naming host:port at once
//    (connection reset) or after the timeout (silent peer), never a hang.
//
// Key protocol in the store, below the namespace "<job_id>/<attempt>/" (see docs/bootstrap.md):
//   reg/<rank>                       registration of a rank (written once, compare-and-set)
//   reg/count                        atomic counter; the rank that brings it to `world` builds
//   topo/host/<hostname>             ... the topology: "<host index>\n<rank:local_rank,...>"
//   topo/hosts                       sorted host list
//   topo/done                        number of hosts (or "!error"), written last: the one barrier
//   group/<kind>/<index>/id          communicator id, written once by the group's leader
//   group/<kind>/<index>/<id>/...    Gloo's full-mesh address exchange for that communicator
#pragma once

#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"

namespace gloo {
class Context;
}  // namespace gloo

namespace ms::bootstrap {

using Millis = std::chrono::milliseconds;

// ---- the 3D grid -------------------------------------------------------------------------

// The kinds of process groups, in the order in which every rank creates them.
enum class GroupKind { kTp = 0, kPp, kDp, kEmbedding, kModelParallel, kWorld };
inline constexpr int kNumGroupKinds = 6;
inline constexpr std::array<GroupKind, kNumGroupKinds> kAllGroupKinds = {
    GroupKind::kTp,   GroupKind::kPp, GroupKind::kDp, GroupKind::kEmbedding, GroupKind::kModelParallel,
    GroupKind::kWorld};
// "tp", "pp", "dp", "embedding", "model_parallel", "world".
std::string_view GroupKindName(GroupKind kind);

// The layout of ranks on a tp x pp x dp grid; tensor-parallel ranks are neighbours:
//
//   rank = (dp_index * pp + pp_index) * tp + tp_index
//
// Worked example, world 16, tp 2, pp 4, dp 2 (Coords written (tp,pp,dp)):
//
//   rank:    0       1       2       3       4       5       6       7
//   coords: (0,0,0) (1,0,0) (0,1,0) (1,1,0) (0,2,0) (1,2,0) (0,3,0) (1,3,0)
//   rank:    8       9       10      11      12      13      14      15
//   coords: (0,0,1) (1,0,1) (0,1,1) (1,1,1) (0,2,1) (1,2,1) (0,3,1) (1,3,1)
//
//   TP groups (same pp, dp; 8 of size 2):  [0,1] [2,3] [4,5] [6,7] [8,9] [10,11] [12,13] [14,15]
//   PP groups (same tp, dp; 4 of size 4):  [0,2,4,6] [1,3,5,7] [8,10,12,14] [9,11,13,15]
//   DP groups (same tp, pp; 8 of size 2):  [0,8] [1,9] [2,10] [3,11] [4,12] [5,13] [6,14] [7,15]
//   embedding (first+last stage of each PP group): [0,6] [1,7] [8,14] [9,15]; ranks 2..5, 10..13
//       are in none. With pp == 1 every rank is its own embedding group ([r]).
//   model-parallel (same dp; TP x PP, 2 of size 8): [0..7] [8..15]
//   world: [0..15]
//
// Group index of a rank (position of its group in AllGroups(kind)):
//   tp: dp*pp + pp_index   pp: dp_index*tp + tp_index   dp: pp_index*tp + tp_index
//   embedding: as pp (pp > 1), the rank itself (pp == 1)   model_parallel: dp_index   world: 0
// Member lists are ascending. A value type: copy freely, thread-safe to read.
struct ParallelGrid {
  int tp = 1;
  int pp = 1;
  int dp = 1;

  struct Coords {
    int tp = 0;
    int pp = 0;
    int dp = 0;
    bool operator==(const Coords&) const = default;
  };

  // InvalidArgument unless world >= 1, tp >= 1, pp >= 1 and tp*pp divides world.
  static Result<ParallelGrid> Make(int world, int tp, int pp);

  int world() const { return tp * pp * dp; }
  Coords CoordsOf(int rank) const;
  int RankOf(const Coords& c) const { return (c.dp * pp + c.pp) * tp + c.tp; }

  std::vector<int> TpGroup(int rank) const;
  std::vector<int> PpGroup(int rank) const;
  std::vector<int> DpGroup(int rank) const;
  std::vector<int> EmbeddingGroup(int rank) const;  // empty when the rank is in none
  std::vector<int> ModelParallelGroup(int rank) const;
  std::vector<int> WorldGroup() const;

  // The group of `kind` containing `rank` (empty if none: only possible for kEmbedding).
  std::vector<int> Group(GroupKind kind, int rank) const;
  // Index of that group in AllGroups(kind), or -1.
  int GroupIndex(GroupKind kind, int rank) const;
  // Every group of a kind, in index order.
  std::vector<std::vector<int>> AllGroups(GroupKind kind) const;
  int NumGroups(GroupKind kind) const;

  // "tp2.pp4.dp2"
  std::string ToString() const;
};

// ---- the store ---------------------------------------------------------------------------

// Operation counters of one Store (one connection): commands sent and RESP bytes both ways.
struct StoreStats {
  int64_t ops = 0;
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t bytes() const { return bytes_sent + bytes_received; }
};

struct CasResult {
  bool swapped = false;                // true if the value was `expected` and is now `desired`
  std::optional<std::string> current;  // the value after the call (nullopt: absent)
};

// A key-value store for bootstrap. All keys are relative to the store's namespace.
// Wait() sees keys written through Set() or CompareAndSet() of any Store on the same namespace
// (it does not poll: the Redis implementation blocks on a per-key notification stream).
class Store {
 public:
  virtual ~Store() = default;

  // Writes key = value (overwrites) and wakes every Wait() on key.
  virtual Status Set(std::string_view key, std::string_view value) = 0;
  // NotFound if absent.
  virtual Result<std::string> Get(std::string_view key) = 0;
  // One round trip; nullopt for absent keys.
  virtual Result<std::vector<std::optional<std::string>>> MultiGet(const std::vector<std::string>& keys) = 0;
  // Returns when every key exists; Timeout (naming the keys still missing) after `timeout`.
  virtual Status Wait(const std::vector<std::string>& keys, Millis timeout) = 0;
  // Wait(), then the keys' values in order. The Redis implementation takes the values from the
  // notifications it waited on: one command per wake-up, no separate read.
  virtual Result<std::vector<std::string>> WaitGet(const std::vector<std::string>& keys, Millis timeout);
  // Atomically adds delta to the integer at key (absent = 0) and returns the new value.
  // (Wait() does not see counters: publish a flag with Set() when a count is reached.)
  virtual Result<int64_t> Add(std::string_view key, int64_t delta) = 0;
  // Atomically: if the value is `expected` (nullopt: key absent) set it to `desired`.
  virtual Result<CasResult> CompareAndSet(std::string_view key, const std::optional<std::string>& expected,
                                          std::string_view desired) = 0;
  // Deletes every key starting with prefix (within the namespace); returns how many.
  virtual Result<int64_t> DeletePrefix(std::string_view prefix) = 0;

  // An id of the server instance (Redis: its run_id). It changes when the server was restarted,
  // which loses every key: a waiter compares it to know that keys written earlier are gone.
  virtual Result<std::string> ServerId() = 0;
  // A new, independent connection to the same store and namespace (its counters start with the
  // connection handshake: AUTH if a password is set, PING).
  virtual Result<std::unique_ptr<Store>> Clone() const = 0;
  virtual StoreStats stats() const = 0;
  // "redis://127.0.0.1:6379/0 ns=job/0/" without the password.
  virtual std::string Describe() const = 0;
};

struct StoreOptions {
  // redis://[[user][:password]@]host:port[/db] or host:port. Never logged.
  std::string url = "redis://127.0.0.1:6379";
  // The password when the URL has none; empty: MEGASCALE_REDIS_PASSWORD, if set. Never logged.
  std::string password;
  std::string job_id = "megascale";  // namespace: "<job_id>/<attempt>/"
  int attempt = 0;
  Millis connect_timeout{5000};  // per connection try
  Millis op_timeout{30000};      // every call but Wait()
  int connect_retries = 4;       // extra tries after a refused/timed-out connect (not after bad auth)
  Millis retry_backoff{100};     // first backoff, doubled per try, capped at 2 s
};

struct RedisEndpoint {
  std::string host;
  int port = 6379;
  std::string user;      // empty: the default user (AUTH password); else an ACL user (AUTH user password)
  std::string password;  // empty: none
  int db = 0;
};
// Parses redis://[[user][:password]@]host:port[/db], and the bare host:port; InvalidArgument (with
// the URL redacted) on anything else.
Result<RedisEndpoint> ParseRedisUrl(std::string_view url);
// The URL with its password replaced by "***".
std::string RedactUrl(std::string_view url);

// Connects (AUTH, SELECT), retrying refused/timed-out connects with exponential backoff.
// Errors name host:port: Unavailable (refused, unreachable, timed out), InvalidArgument (bad URL),
// FailedPrecondition (authentication refused or required).
Result<std::unique_ptr<Store>> ConnectRedisStore(const StoreOptions& options);

// One global barrier built on the store: Add(key/count); the rank that completes the count sets
// key/done; the others Wait() for it. Each key may be used for one barrier only.
Status StoreBarrier(Store& store, std::string_view key, int world, Millis timeout);

// ---- embedded redis-server ---------------------------------------------------------------

struct EmbeddedRedisOptions {
  int max_clients = 10000;                  // --maxclients; the server caps it at the fd limit (~19,968 here)
  std::string executable = "redis-server";  // looked up in PATH
  std::string temp_parent;                  // parent of the private directory; empty: $TMPDIR or /tmp
  std::string bind_address = "127.0.0.1";   // the one address it listens on (a multi-host job: this host's
                                            // address on the interface that reaches the other hosts)
  Millis startup_timeout{10000};            // until PING answers
  Millis stop_timeout{5000};                // SHUTDOWN NOSAVE, then SIGKILL
};

// A redis-server child process on a free port of one address, with no persistence, a random
// password (written to a 0600 config file, never on the command line or in url()), --tcp-backlog
// 4096, and its pid file and log in a private temporary directory. RAII: the destructor stops it
// and removes the directory. Movable, not copyable.
//
// Signals: the server is started with SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 blocked, so a
// signal sent to every process of a job (Slurm's SIGTERM at a time limit, `kill` of a process
// group, scancel) leaves it running until the ranks have used it for their last checkpoint; the
// owner stops it with SHUTDOWN NOSAVE (SIGKILL when that fails). PR_SET_PDEATHSIG(SIGKILL): if the
// thread that called Start() dies (even by SIGKILL), the server goes too -- call Start() from a
// thread that lives as long as the job. Not thread-safe; Stop() is idempotent.
class EmbeddedRedis {
 public:
  // NotFound (telling to run scripts/setup.sh) if redis-server is missing; Unavailable if it
  // does not answer PING in time (with the tail of its log).
  static Result<EmbeddedRedis> Start(const EmbeddedRedisOptions& options = {});

  EmbeddedRedis(EmbeddedRedis&& other) noexcept;
  EmbeddedRedis& operator=(EmbeddedRedis&& other) noexcept;
  EmbeddedRedis(const EmbeddedRedis&) = delete;
  EmbeddedRedis& operator=(const EmbeddedRedis&) = delete;
  ~EmbeddedRedis();

  // Stops the server (SHUTDOWN NOSAVE, SIGKILL after stop_timeout) and removes its directory. OK
  // if already stopped.
  Status Stop();
  // Reaps the server if it has exited (waitpid on its PID only): its wait status, and from then
  // on running() is false; nullopt while it runs (or when it was stopped by Stop()).
  std::optional<int> PollExit();
  // Starts a new server on the same address, port and password after the old one died, so that
  // clients reconnect to it (keys are lost). Unavailable when the port was taken meanwhile.
  Status Restart();

  bool running() const { return pid_ > 0; }
  // redis://<address>:<port>/0 -- without the password (see password()).
  const std::string& url() const { return url_; }
  // The random password: pass it on in the environment (MEGASCALE_REDIS_PASSWORD), never log it.
  const std::string& password() const { return password_; }
  pid_t pid() const { return pid_; }
  int port() const { return port_; }
  const std::string& address() const { return options_.bind_address; }
  const std::string& dir() const { return dir_; }
  // The tail of the server's log (for messages after it died).
  std::string LogTail() const;

 private:
  EmbeddedRedis() = default;
  Status Launch(int port);  // writes the config, forks and execs, waits for PING
  pid_t pid_ = -1;
  int port_ = 0;
  std::string url_;
  std::string password_;
  std::string dir_;
  std::string exe_;
  EmbeddedRedisOptions options_;
};

// ---- rendezvous --------------------------------------------------------------------------

// What a rank tells the others about itself.
struct RankInfo {
  int rank = -1;
  std::string hostname;
  int local_rank = -1;  // -1: derive from the registrations (position among the host's ranks)
  int device = -1;      // accelerator index, -1 for none
  int pid = 0;
  std::string address;  // the address its communicators listen on (e.g. 127.0.0.1)
};
// Rank from MEGASCALE_RANK or SLURM_PROCID (else fallback_rank), local rank from
// MEGASCALE_LOCAL_RANK or SLURM_LOCALID, hostname, pid, address (MEGASCALE_LISTEN_ADDRESS, else
// "127.0.0.1"). InvalidArgument if a variable is not an integer.
Result<RankInfo> RankInfoFromEnv(int fallback_rank);

// Time, store operations and bytes of one bootstrap step on one rank.
struct PhaseTiming {
  std::string name;
  double start = 0;  // NowSeconds()
  double end = 0;
  int64_t ops = 0;
  int64_t bytes = 0;
};

struct Topology {
  int world = 0;
  int rank = -1;
  ParallelGrid grid;
  int num_hosts = 0;            // distinct hostnames (ReadHosts() lists them, sorted)
  int host_index = -1;          // index of this rank's host in that list
  std::vector<int> host_ranks;  // global ranks on this host, ascending
  int local_rank = -1;
  int local_world = 0;
  std::vector<PhaseTiming> phases;  // "register", "topology"
};

// Registers `me` and derives the topology. Exactly one global barrier: the rank whose
// registration completes the count reads all registrations (one MultiGet), validates them (same
// world and grid everywhere, local ranks unique per host) and publishes the topology; every
// other rank waits for it and reads only the host count and its own host's ranks (one MultiGet
// of two small keys: the full host list is not sent to every rank, see ReadHosts()).
// Errors: InvalidArgument (grid does not match world, rank out of range, rank registered twice,
// inconsistent registrations -- reported on every rank), Timeout, Unavailable.
Result<Topology> Rendezvous(Store& store, const RankInfo& me, int world, const ParallelGrid& grid, Millis timeout);
// The sorted host list published by the rendezvous (for the driver and diagnostics).
Result<std::vector<std::string>> ReadHosts(Store& store);
// All registrations (for the driver and diagnostics): one MultiGet.
Result<std::vector<RankInfo>> ReadRegistrations(Store& store, int world);

// ---- communicator ids and process groups -------------------------------------------------

// The communicator id of each group this rank is in ("" for kinds it is in none of, and for
// size-1 groups, which need no exchange). Every rank first publishes the ids of the groups it
// leads (lowest rank of the group), then reads the others kind by kind in kAllGroupKinds order,
// waiting only on keys of its own groups. `id_bytes` is the size of a published id (a Gloo id is
// 16 random bytes in hex; an ncclUniqueId is 128). `baseline` does the same work the way a
// TCPStore-style initializer does: every group of every kind in turn, each followed by a global
// barrier in which every rank takes part (`baseline_max_groups` > 0 stops after that many).
// `on_group` (may be empty) is called after the id of each of this rank's groups is known --
// CreateProcessGroups builds the communicator there.
struct GroupExchangeOptions {
  Millis timeout{60000};
  int id_bytes = 32;
  bool baseline = false;
  int baseline_max_groups = 0;
  uint64_t seed = 0;  // for the ids; 0: from the clock and pid
  std::function<Status(GroupKind, int group_index, const std::vector<int>& members, const std::string& id)> on_group;
};
struct GroupIds {
  std::array<std::string, kNumGroupKinds> id;
  std::vector<PhaseTiming> phases;  // one per kind ("tp", ...), baseline adds "barriers"
  int baseline_groups_done = 0;     // baseline: groups created (all, unless capped)
};
Result<GroupIds> ExchangeGroupIds(Store& store, const ParallelGrid& grid, int rank,
                                  const GroupExchangeOptions& options);

// The Gloo communicators of one rank, one per group kind; nullptr for a group the rank is not in
// (only `embedding` on middle pipeline stages). Owned jointly (shared_ptr); a later Communicator
// wraps them. Contexts are not thread-safe: one collective at a time per context.
struct ProcessGroups {
  std::shared_ptr<gloo::Context> tp, pp, dp, embedding, model_parallel, world;
  std::array<std::vector<int>, kNumGroupKinds> members;  // global ranks, by GroupKind
  std::vector<PhaseTiming> phases;                       // per kind
  std::string loop_note;  // what became of the TCP device's event-loop thread (comm::MakeGlooTcpDevice)
  std::shared_ptr<gloo::Context> Get(GroupKind kind) const;
};

struct ProcessGroupOptions {
  Millis timeout{60000};                     // store waits and each Gloo operation
  std::string listen_address = "127.0.0.1";  // the TCP device binds here (RankInfo::address)
  bool baseline = false;                     // see GroupExchangeOptions
};
// Builds Gloo full-mesh contexts for every group of topology.rank in kAllGroupKinds order, each
// from the id its leader published, through a gloo::rendezvous::Store adapter over `store` with a
// prefix per communicator id. No rank waits on a group it is not in (except in baseline mode).
Result<ProcessGroups> CreateProcessGroups(Store& store, const Topology& topology, const ProcessGroupOptions& options);

// All-reduces, in every group of `groups`, a vector of world int64s that is one-hot at the rank
// plus a value (rank+1), and checks the result against the grid formula: members and sum.
// Returns a short description per group ("tp[1] members 2,3 sum 7 ok"); InvalidArgument on a
// mismatch (naming the group, expected and actual), Unavailable/Timeout on transport errors.
Result<std::vector<std::string>> CheckGroupsAllReduce(const ProcessGroups& groups, const ParallelGrid& grid, int rank,
                                                      Millis timeout);

// ---- NCCL communicators (CUDA backend; compiled when nvcc and NCCL are present) -------------

// A group's shared secret (an ncclUniqueId, as bytes) made once by the group's leader (rank_in_group 0) with
// `make` and published under `key` (e.g. "nccl/dp/3"); the members read it with one blocking WaitGet. No global
// barrier; ranks not in the group never touch the key. Order groups as CreateProcessGroups does
// (kAllGroupKinds) so that no rank waits on a group it is not in.
Result<std::string> ShareGroupId(Store& store, const std::string& key, int rank_in_group, int group_size,
                                 Millis timeout, const std::function<Result<std::string>()>& make);

// ---- megascale init-test ------------------------------------------------------------------

struct InitTestOptions {
  int ranks = 8;
  int tp = 1;
  int pp = 1;
  std::string mode = "simulated";  // simulated | real
  bool baseline = true;            // also run the baseline initializer, for comparison
  int baseline_max_groups = 0;     // 0: automatic (all groups if it stays under ~3M store ops)
  std::string redis_url;           // empty: start an embedded redis-server
  std::string json_path;           // empty: none
  Millis timeout{120000};          // whole run, and each wait
  int ranks_per_host = 8;          // simulated hostnames: sim-host-<rank / ranks_per_host>
  std::string job_id = "init-test";
  int id_bytes = 128;              // simulated: published id size (ncclUniqueId)
  std::string launcher = "local";  // real: local | srun
  // real: how to start a worker (argv prefix; the worker flags are appended). The megascale
  // binary passes {"/proc/self/exe", "init-test"}.
  std::vector<std::string> worker_command;
  bool progress = true;  // progress lines on stderr
};

struct PhaseReport {
  std::string name;
  double seconds = 0;       // first rank entering to last rank leaving
  double mean_rank_ms = 0;  // mean over ranks of the rank's own time in the phase
  int64_t ops = 0;          // store operations, all ranks
  int64_t bytes = 0;        // RESP bytes both ways, all ranks
};
struct ModeReport {
  std::string initializer;          // "megascale" | "baseline"
  std::vector<PhaseReport> phases;  // connect, register, topology, tp, pp, dp, embedding, model_parallel, world, ...
  PhaseReport total;
  std::string note;  // e.g. "extrapolated from 100 of 4865 groups"
};
struct InitTestReport {
  int ranks = 0;
  ParallelGrid grid;
  std::string mode;
  std::vector<ModeReport> runs;
  std::vector<std::string> checks;  // real mode: one line per group check
};

// Validates options (InvalidArgument for N < 1, a layout that does not divide N, ...), starts an
// embedded Redis if none is given, runs the initializers and returns the report.
Result<InitTestReport> RunInitTest(const InitTestOptions& options);
std::string FormatTable(const InitTestReport& report);
std::string ToJson(const InitTestReport& report);

// Worker side of real mode: one rank. The parent passes these as hidden flags (names below).
struct InitTestWorkerOptions {
  int rank = -1;           // --worker-rank (-1: from MEGASCALE_RANK / SLURM_PROCID)
  int world = 0;           // --worker-world
  int tp = 1;              // --tp
  int pp = 1;              // --pp
  std::string redis_url;   // --redis
  std::string job_id;      // --job-id
  int attempt = 0;         // --worker-attempt
  bool baseline = false;   // --worker-baseline
  Millis timeout{60000};   // --timeout (seconds on the command line)
  std::string result_dir;  // --worker-results: the worker writes rank-<r>.txt here
};
// The worker flags for `options` (appended to InitTestOptions::worker_command).
std::vector<std::string> WorkerArgs(const InitTestWorkerOptions& options);
// Runs one real rank: connect, rendezvous, Gloo groups, checked all-reduces; writes its timings
// and checks to result_dir/rank-<r>.txt. Returns the process exit code (0 ok); errors go to stderr.
int RunInitTestWorker(const InitTestWorkerOptions& options);

}  // namespace ms::bootstrap
