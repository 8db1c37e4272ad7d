#include "runner/signals.h"

#include "runner/runner.h"

#include <signal.h>

#include <atomic>
#include <thread>

namespace ms::runner {
namespace {

std::atomic<int> g_interrupt{0}, g_terminate{0}, g_save{0};
std::atomic<bool> g_installed{false};

extern "C" void OnStopSignal(int sig) {
  if (sig == SIGINT) g_interrupt.fetch_add(1);
  if (sig == SIGTERM) g_terminate.fetch_add(1);
  if (sig == SIGUSR1) g_save.fetch_add(1);
}

}  // namespace

void InstallStopSignals() {
  if (g_installed.exchange(true)) return;
  // A write to a peer that has died (a Gloo pair, the store's connection, a heartbeat socket) must
  // fail with EPIPE, which the caller reports, not kill this process with SIGPIPE: a rank whose peer
  // was killed would otherwise die by a signal too, and could be blamed for the crash it only saw.
  // Spawn restores the default for the programs it starts.
  signal(SIGPIPE, SIG_IGN);
  // The signals stay blocked in this thread and in every thread it creates from now on (compute,
  // communication, checkpoint writer: none is ever interrupted by them), and one thread takes them
  // with sigwait. A signal frame pushed onto an arbitrary thread, and the EINTRs it causes in the
  // libraries underneath, corrupted the heap of a training rank about one time in three.
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&set, sig);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  // A thread that existed before (none in megascale's processes) would still take them: count there too.
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaction(sig, &sa, nullptr);  // cannot fail for these
  std::thread([set] {
    while (true) {
      int sig = 0;
      if (sigwait(&set, &sig) == 0) OnStopSignal(sig);
    }
  }).detach();
}

SignalCounts TakeSignals() {
  SignalCounts c;
  c.interrupt = g_interrupt.exchange(0);
  c.terminate = g_terminate.exchange(0);
  c.save = g_save.exchange(0);
  return c;
}

int TakeStopSignal() {
  const SignalCounts c = TakeSignals();
  return c.interrupt > 0 ? SIGINT : c.terminate > 0 ? SIGTERM : 0;
}

void ReturnSignals(const SignalCounts& counts) {
  g_interrupt.fetch_add(counts.interrupt);
  g_terminate.fetch_add(counts.terminate);
  g_save.fetch_add(counts.save);
}

}  // namespace ms::runner
