// SpinUntil: polls a condition for a short while before a thread sleeps.
// Waking a sleeping thread costs a system call and, on a virtual machine, an
// interrupt to the sleeping CPU: tens of microseconds, more than a small copy
// or a small call's work. A thread that expects more work soon polls first.
//
// clang-format off
//   if (!SpinUntil([&] { return ready.load(); }, std::chrono::microseconds(50)))
//     BlockUntilReady();
// clang-format on
#ifndef PACKD_BASE_SPIN_WAIT_H_
#define PACKD_BASE_SPIN_WAIT_H_

#include <chrono>

namespace packd {

// Polls done() until it holds (true) or `budget` has passed (false).
template <typename Done>
bool SpinUntil(Done&& done, std::chrono::microseconds budget) {
  const auto deadline = std::chrono::steady_clock::now() + budget;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
    if (std::chrono::steady_clock::now() >= deadline) return done();
  }
}

}  // namespace packd

#endif  // PACKD_BASE_SPIN_WAIT_H_
