// The CPU backend ("span", the default on cpu): packing as copies of whole runs
// of consecutive active positions, which are contiguous in both the dense and
// the packed tensor, split across ThreadPool::Global(). Narrow rows (1 to 16
// bytes) under a fragmented mask are compacted with a branch-free typed loop
// instead, where one memcpy per run would cost more than the bytes it moves.
//
// clang-format off
//   RegisterCpuBackends(Registry::Global());  // Registry::Global() does this
//   ParallelCopy(dst, src, n);                // the copy benchmarks measure packd against
// clang-format on
#ifndef PACKD_KERNELS_CPU_CPU_BACKEND_H_
#define PACKD_KERNELS_CPU_CPU_BACKEND_H_

#include <cstddef>

namespace packd {

class Registry;

// Adds the "span" backend for cpu, as the default.
void RegisterCpuBackends(Registry& registry);

// memcpy / memset of `bytes`, split into equal parts across
// ThreadPool::Global() when large.
void ParallelCopy(void* dst, const void* src, size_t bytes);
void ParallelZero(void* dst, size_t bytes);

}  // namespace packd

#endif  // PACKD_KERNELS_CPU_CPU_BACKEND_H_
