// Internal to the runner: fault injection for tests. Off unless the variable MEGASCALE_FAULT is
// set, which only tests set (documented as a test hook in docs/jobs.md, never for a real run):
//
//   MEGASCALE_FAULT="delay:at=restore_read:rank=0:s=5;delay:at=resume_scan:s=4"
//
// Entries are separated by ';', fields by ':'. The first field is the kind; the others are
// key=value; `attempt=<a>` (default 0) limits an entry of the training kinds to one attempt of the
// job (MEGASCALE_ATTEMPT), so that the restarted job runs undisturbed. Kinds:
//   delay  at=<point> [rank=<r>] s=<seconds>   sleeps at a named point (of rank r only, if given)
//   nan    rank=<r> step=<s>                   a NaN in rank r's gradient at step s
//   slow   rank=<r> factor=<f>                 rank r computes f times as long (a straggler)
//   hang   rank=<r> step=<s>                   rank r stops making progress at the start of step s
//   crash  rank=<r> step=<s>                   rank r kills itself (SIGKILL) at the start of step s
//   slow_gemm rank=<r> factor=<f>              self-check: rank r's GEMM test takes f times as long
//   slow_link rank=<r> factor=<f>              self-check: rank r's point-to-point sends take f times as long
//   loader_stall rank=<r> step=<s>             the shared data loader in rank r stops publishing at step s
// Points: resume_scan (the driver's checkpoint scan), restore_read (a rank's checkpoint read,
// before its data-parallel peers are sent what it read), train_start (a rank, after start-up and
// restore, before its first step), train_end (a rank, after its last step and checkpoint, before it exits).
// A malformed entry is reported once (LogWarn) and ignored.
#pragma once

#include <cstdint>
#include <string_view>

namespace ms::runner {

// Sleeps when MEGASCALE_FAULT asks for a delay at `point` for this rank (-1: any rank).
void InjectDelay(std::string_view point, int rank);
// True when a NaN is to be planted in this rank's gradient at this step.
bool InjectNan(int rank, int64_t step);
// True when the shared data loader running in this rank is to stop publishing at this step.
bool InjectLoaderStall(int rank, int64_t step);
// The compute slow-down of this rank (1: none).
double SlowFactor(int rank);
// The factor of a slow-down `kind` (slow, slow_gemm, slow_link) for this rank (1: none).
double InjectedFactor(std::string_view kind, int rank);
// Never returns when this rank is to hang at this step (sleeps in a compute phase), or to crash.
void InjectHang(int rank, int64_t step);
// Keeps this thread busy for `seconds` (a slow device takes CPU time, not sleep).
void BurnCpu(double seconds);

}  // namespace ms::runner
