// Subcommands of the megascale binary. Each Add*Command adds its subcommand to `parent`,
// binds its flags, sets `*run` to the function main() calls when that subcommand was the
// one parsed, and returns the subcommand. The function
// returns the process exit code. Nothing here does work itself: it calls into lib/.
#pragma once

#include <functional>

#include <CLI/CLI.hpp>

#include "core/core.h"

namespace ms::cmd {

using RunFn = std::function<int()>;

CLI::App* AddTrainCommand(CLI::App& parent, RunFn* run);
CLI::App* AddResumeCommand(CLI::App& parent, RunFn* run);
CLI::App* AddWorkerCommand(CLI::App& parent, RunFn* run);
CLI::App* AddValidateCommand(CLI::App& parent, RunFn* run);
CLI::App* AddPrepareDataCommand(CLI::App& parent, RunFn* run);
CLI::App* AddInitTestCommand(CLI::App& parent, RunFn* run);
CLI::App* AddBenchCommand(CLI::App& parent, RunFn* run);
CLI::App* AddExportCommand(CLI::App& parent, RunFn* run);
CLI::App* AddSelfCheckCommand(CLI::App& parent, RunFn* run);
CLI::App* AddGenerateCommand(CLI::App& parent, RunFn* run);
CLI::App* AddReportCommand(CLI::App& parent, RunFn* run);

// Prints "error: <message>" to stderr and returns 1: the one error boundary.
int ReportError(const Status& status);

}  // namespace ms::cmd
