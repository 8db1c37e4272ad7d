#include "runner/signals.h"

#include <signal.h>

#include <atomic>

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
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  // sigaction cannot fail for these signal numbers with a valid handler.
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
  // A worker starts with them blocked (see LaunchLocal): what arrived meanwhile is delivered now.
  sigset_t set;
  sigemptyset(&set);
  for (int sig : {SIGINT, SIGTERM, SIGUSR1}) sigaddset(&set, sig);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
}

SignalCounts TakeSignals() {
  SignalCounts c;
  c.interrupt = g_interrupt.exchange(0);
  c.terminate = g_terminate.exchange(0);
  c.save = g_save.exchange(0);
  return c;
}

void ReturnSignals(const SignalCounts& counts) {
  g_interrupt.fetch_add(counts.interrupt);
  g_terminate.fetch_add(counts.terminate);
  g_save.fetch_add(counts.save);
}

}  // namespace ms::runner
