#include "client/shared_memory.h"

#include <utility>

namespace packd {

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(
    std::string key, std::string region, int64_t bytes,
    std::function<void()> on_close) {
  return CreateAs<SharedMemory>(std::move(key), std::move(region), bytes,
                                std::move(on_close));
}

at::Tensor SharedMemory::Empty(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  char* p = Allocate(n * static_cast<int64_t>(c10::elementSize(dtype)));
  if (p == nullptr) return at::Tensor();
  return at::from_blob(p, shape, at::TensorOptions().dtype(dtype));
}

}  // namespace packd
