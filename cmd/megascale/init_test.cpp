// megascale init-test: times rank bootstrap and group initialization (lib/bootstrap).
// Argument binding only. The hidden --worker-* flags make this binary one rank of real mode.
#include <cstdio>
#include <memory>

#include "bootstrap/bootstrap.h"
#include "cmd/megascale/commands.h"

namespace ms::cmd {

CLI::App* AddInitTestCommand(CLI::App& parent, RunFn* run) {
  CLI::App* sub = parent.add_subcommand(
      "init-test",
      "Time rank bootstrap and group initialization through Redis (megascale vs. a TCPStore-style baseline)");
  struct Args {
    bootstrap::InitTestOptions opt;
    bootstrap::InitTestWorkerOptions worker;
    double timeout_s = 120;
    bool no_baseline = false;
    bool quiet = false;
  };
  auto a = std::make_shared<Args>();
  sub->add_option("--ranks,-n", a->opt.ranks, "number of ranks N")->capture_default_str();
  sub->add_option("--tp", a->opt.tp, "tensor-parallel size")->capture_default_str();
  sub->add_option("--pp", a->opt.pp, "pipeline-parallel size (dp = N / (tp*pp))")->capture_default_str();
  sub->add_option("--mode", a->opt.mode,
                  "simulated: N lightweight ranks (a thread and a connection each) in this process; real: N worker "
                  "processes building Gloo communicators, with a checked all-reduce in every group")
      ->check(CLI::IsMember({"simulated", "real"}))
      ->capture_default_str();
  sub->add_flag("--no-baseline", a->no_baseline, "skip the baseline (TCPStore-style) initializer");
  sub->add_option("--baseline-max-groups", a->opt.baseline_max_groups,
                  "stop the baseline after this many groups and extrapolate (0: automatic)")
      ->capture_default_str();
  sub->add_option("--redis", a->opt.redis_url,
                  "redis://[:password@]host:port[/db] (password also from MEGASCALE_REDIS_PASSWORD); default: start an "
                  "embedded redis-server");
  sub->add_option("--json", a->opt.json_path, "also write the table as JSON to this file");
  sub->add_option("--timeout", a->timeout_s, "seconds: each wait, and the whole run")->capture_default_str();
  sub->add_option("--ranks-per-host", a->opt.ranks_per_host, "simulated: ranks per (simulated) host")
      ->capture_default_str();
  sub->add_option("--launcher", a->opt.launcher, "real: local processes, or srun inside a Slurm allocation")
      ->check(CLI::IsMember({"local", "srun"}))
      ->capture_default_str();
  sub->add_option("--job-id", a->opt.job_id, "job id (store namespace)")->capture_default_str();
  sub->add_flag("--quiet,-q", a->quiet, "no progress lines");
  // Hidden: one rank of real mode.
  sub->add_option("--worker-rank", a->worker.rank)->group("");
  sub->add_option("--worker-world", a->worker.world)->group("");
  sub->add_option("--worker-attempt", a->worker.attempt)->group("");
  sub->add_option("--worker-results", a->worker.result_dir)->group("");
  sub->add_flag("--worker-baseline", a->worker.baseline)->group("");

  *run = [a, sub]() -> int {
    const auto timeout = bootstrap::Millis(static_cast<int64_t>(a->timeout_s * 1000));
    if (sub->count("--worker-world") > 0) {
      bootstrap::InitTestWorkerOptions w = a->worker;
      w.tp = a->opt.tp;
      w.pp = a->opt.pp;
      w.redis_url = a->opt.redis_url;
      w.job_id = a->opt.job_id;
      w.timeout = timeout;
      return bootstrap::RunInitTestWorker(w);
    }
    bootstrap::InitTestOptions opt = a->opt;
    opt.timeout = timeout;
    opt.baseline = !a->no_baseline;
    opt.progress = !a->quiet;
    auto self = SelfExecutable();  // a path every node can run (an srun task's /proc/self/exe is slurmstepd)
    if (!self.ok()) return ReportError(self.status());
    opt.worker_command = {*self, "init-test"};
    auto report = bootstrap::RunInitTest(opt);
    if (!report.ok()) return ReportError(report.status());
    std::fputs(bootstrap::FormatTable(*report).c_str(), stdout);
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
