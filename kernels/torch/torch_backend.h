// The libtorch backend ("torch" on cpu): packing with libtorch's own ops,
// nonzero + index_select for pack and index_copy_ into zeros for scatter. It is
// the reference the fast backends are measured against, selectable by name.
//
// clang-format off
//   RegisterTorchBackends(Registry::Global());  // Registry::Global() does this
//   options.impl = "torch";  Pack(inputs, mask, options);
// clang-format on
#ifndef PACKD_KERNELS_TORCH_TORCH_BACKEND_H_
#define PACKD_KERNELS_TORCH_TORCH_BACKEND_H_

namespace packd {

class Registry;

// Adds the "torch" backend for cpu (not the default).
void RegisterTorchBackends(Registry& registry);

}  // namespace packd

#endif  // PACKD_KERNELS_TORCH_TORCH_BACKEND_H_
