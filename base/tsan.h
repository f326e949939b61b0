// Hand-offs ThreadSanitizer cannot see: a value one thread hands to an
// uninstrumented library (the system's gRPC) and another thread receives from
// it (a call's completion callback, a slice's release). HandOff(p) before
// giving the library `p`, and TakeOver(p) where it comes back, tell TSan what
// the library's own locks guarantee. No-ops in other builds.
//
//   HandOff(this);  // OnDone runs on one of gRPC's threads
//   Finish(status);
#ifndef PACKD_BASE_TSAN_H_
#define PACKD_BASE_TSAN_H_

#if defined(__SANITIZE_THREAD__)
#define PACKD_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PACKD_TSAN 1
#endif
#endif

#ifdef PACKD_TSAN
extern "C" void __tsan_acquire(void* addr);
extern "C" void __tsan_release(void* addr);
#endif

namespace packd {

#ifdef PACKD_TSAN
inline void HandOff(const void* p) { __tsan_release(const_cast<void*>(p)); }
inline void TakeOver(const void* p) { __tsan_acquire(const_cast<void*>(p)); }
#else
inline void HandOff(const void*) {}
inline void TakeOver(const void*) {}
#endif

}  // namespace packd

#endif  // PACKD_BASE_TSAN_H_
