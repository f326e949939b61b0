#include "client/shared_memory.h"

#include <utility>

namespace packd {

absl::StatusOr<std::unique_ptr<SharedMemory>> SharedMemory::Create(
    std::string key, std::string region, int64_t bytes,
    std::function<void()> on_close) {
  absl::StatusOr<std::unique_ptr<ShmSegment>> segment =
      ShmSegment::Create(std::move(key), bytes);
  if (!segment.ok()) return segment.status();
  std::unique_ptr<SharedMemory> shm(new SharedMemory);
  shm->segment_ = std::move(*segment);
  shm->region_ = std::move(region);
  shm->data_ = shm->segment_->data();
  shm->size_ = bytes;
  shm->on_close_ = std::move(on_close);
  return shm;
}

SharedMemory::~SharedMemory() {
  if (on_close_) on_close_();
}

char* SharedMemory::Allocate(int64_t bytes) {
  const int64_t start = (used_ + 63) / 64 * 64;
  if (bytes < 0 || start + bytes > size_) return nullptr;
  used_ = start + bytes;
  return data_ + start;
}

at::Tensor SharedMemory::Empty(at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  char* p = Allocate(n * static_cast<int64_t>(c10::elementSize(dtype)));
  if (p == nullptr) return at::Tensor();
  return at::from_blob(p, shape, at::TensorOptions().dtype(dtype));
}

bool SharedMemory::Contains(const void* p, int64_t bytes,
                            v1::RegionSlice* slice) const {
  const char* c = static_cast<const char*>(p);
  if (c < data_ || bytes < 0 || c + bytes > data_ + size_) return false;
  slice->set_region(region_);
  slice->set_offset(static_cast<uint64_t>(c - data_));
  slice->set_byte_size(static_cast<uint64_t>(bytes));
  return true;
}

}  // namespace packd
