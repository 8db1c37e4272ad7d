// Internal to the runner: the job's stop and save signals, caught from the first instruction of
// the driver and of every worker, so that a signal during start-up (rendezvous, data scan, model
// build, restore: minutes at scale) is remembered and honoured once training can act on it,
// instead of killing the process.
//
//   SIGTERM  save a checkpoint, then stop (what Slurm sends at a time limit, on scancel and on
//            preemption); the job exits kExitSaved when the checkpoint is committed
//   SIGUSR1  save a checkpoint and go on (Slurm's --signal=B:USR1@120 warning)
//   SIGINT   stop after the current step without saving (Ctrl-C)
//
// The signals are blocked in every thread and taken by one thread with sigwait, which only counts
// them: no compute, communication or I/O thread is ever interrupted by them (a signal handler run
// on an arbitrary thread corrupted the heap of a rank under load; tests/runner/reliability_test.py
// sends such signals mid-step).
#pragma once

namespace ms::runner {

struct SignalCounts {
  int interrupt = 0;  // SIGINT
  int terminate = 0;  // SIGTERM
  int save = 0;       // SIGUSR1
  bool any() const { return interrupt + terminate + save > 0; }
};

// InstallStopSignals() is declared in runner/runner.h (called by the CLI before anything else).
// The signals received since the last call (and forgets them).
SignalCounts TakeSignals();
// Puts counts back (a caller that took them but cannot act yet).
void ReturnSignals(const SignalCounts& counts);

}  // namespace ms::runner
