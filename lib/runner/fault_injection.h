// Internal to the runner: fault injection for tests. Off unless the variable MEGASCALE_FAULT is
// set, which only tests set (documented as a test hook in docs/jobs.md, never for a real run):
//
//   MEGASCALE_FAULT="delay:at=restore_read:rank=0:s=5;delay:at=resume_scan:s=4"
//
// Entries are separated by ';', fields by ':'. The first field is the kind; the others are
// key=value. Kinds:
//   delay  at=<point> [rank=<r>] s=<seconds>   sleeps at a named point (of rank r only, if given)
// Points: resume_scan (the driver's checkpoint scan), restore_read (a rank's checkpoint read,
// before its data-parallel peers are sent what it read), train_start (a rank, after start-up and
// restore, before its first step).
// A malformed entry is reported once (LogWarn) and ignored.
#pragma once

#include <string_view>

namespace ms::runner {

// Sleeps when MEGASCALE_FAULT asks for a delay at `point` for this rank (-1: any rank).
void InjectDelay(std::string_view point, int rank);

}  // namespace ms::runner
