// Internal to the runner: the driver's small decisions, exposed for unit tests.
#pragma once

#include <string>

#include "config/config.h"

namespace ms::runner {

// The store namespace of a job: its name (free text in the spec: spaces, quotes, anything) cut
// down to [A-Za-z0-9._-] (at most 40 characters), plus "-" and 12 random hex digits, so that two
// jobs never share keys.
std::string JobId(const std::string& name);
// Parameters of the model (all shards together), from its shape.
double ApproxParams(const config::ModelSpec& m);
// The time ranks get after SIGTERM to finish their step, commit the checkpoint and exit:
// runtime.stop_grace_s, or (0) 60 s plus 1 s per 100 MB of checkpoint (parameters and both Adam
// moments in fp32), so that a large model's save is not cut short by a fixed timeout.
double StopGraceSeconds(const config::JobSpec& spec);

}  // namespace ms::runner
