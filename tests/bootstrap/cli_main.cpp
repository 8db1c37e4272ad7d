// Test stand-in for cmd/megascale/main.cpp with only the init-test subcommand.
#include <cstdio>

#include "cmd/megascale/commands.h"

namespace ms::cmd {
int ReportError(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return 1;
}
}  // namespace ms::cmd

int main(int argc, char** argv) {
  CLI::App app{"bootstrap_cli: megascale init-test for the bootstrap tests", "bootstrap_cli"};
  app.require_subcommand(1);
  ms::cmd::RunFn run;
  CLI::App* sub = ms::cmd::AddInitTestCommand(app, &run);
  CLI11_PARSE(app, argc, argv);
  if (sub->parsed() && run) return run();
  return 1;
}
