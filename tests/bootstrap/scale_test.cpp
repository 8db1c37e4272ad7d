#include <doctest/doctest.h>

#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {

TEST_CASE("simulated mode completes for 12,288 ranks (tp 8, pp 8) on this machine") {
  InitTestOptions o;
  o.ranks = 12288;
  o.tp = 8;
  o.pp = 8;
  o.baseline = true;
  o.baseline_max_groups = 8;  // the baseline's trend only; the benchmark runs more
  o.timeout = Millis(300000);
  auto r = RunInitTest(o);
  REQUIRE_MESSAGE(r.ok(), r.status().ToString());
  MESSAGE(FormatTable(*r));
  REQUIRE(r->runs.size() == 2);
  CHECK(r->runs[0].phases[0].ops == 12288);  // one AUTH each
  CHECK(r->runs[0].total.seconds < 60.0);
  CHECK(r->runs[1].total.seconds > r->runs[0].total.seconds);
}

}  // namespace ms::bootstrap
