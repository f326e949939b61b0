// How a client call waits for the GPU work its caller queued before it (the
// inputs written, the results' memory free) before packd, another process,
// touches that memory: on the caller's current stream, by an event recorded
// there and waited for, and not on the whole device, whose other streams
// (NCCL's, other threads') may run for long. A null stream is a stream too:
// CUDA's legacy default stream, libtorch's default (its current stream unless
// the caller set another); an event recorded there completes after the work
// of every blocking stream queued before it, and never waits for a
// non-blocking one (NCCL's). Only where the build cannot see the caller's
// stream at all (libtorch without CUDA: `stream` nullopt) does it wait for the
// device. `Runtime` is the CUDA runtime's calls (client/cuda_device_memory.cc)
// or the fake GPU's (tests/client/fake_gpu_memory.h):
//
//   struct Runtime {
//     using Event = ...;
//     absl::Status SynchronizeDevice();
//     absl::StatusOr<Event> RecordEvent(void* stream);
//     absl::Status SynchronizeEvent(Event event);
//     void DestroyEvent(Event event);
//   };
#ifndef PACKD_CLIENT_STREAM_ORDER_H_
#define PACKD_CLIENT_STREAM_ORDER_H_

#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace packd {

template <typename Runtime>
absl::Status WaitForCallersWork(Runtime& runtime, std::optional<void*> stream) {
  if (!stream.has_value()) return runtime.SynchronizeDevice();
  absl::StatusOr<typename Runtime::Event> event = runtime.RecordEvent(*stream);
  if (!event.ok()) return event.status();
  absl::Status done = runtime.SynchronizeEvent(*event);
  runtime.DestroyEvent(*event);
  return done;
}

}  // namespace packd

#endif  // PACKD_CLIENT_STREAM_ORDER_H_
