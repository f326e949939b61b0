// PackWithGrad: Pack through packd as a differentiable op for C++ trainers.
// Backward scatters the incoming gradient through packd (grad_x =
// Scatter(grad_packed)), so the whole backward pass of packing runs in the
// service.
//
// clang-format off
//   PACKD_ASSIGN_OR_RETURN(at::Tensor packed, PackWithGrad(*client, hidden, mask));
//   loss(packed).backward();  // hidden.grad() is set through Client::Scatter
// clang-format on
#ifndef PACKD_CLIENT_AUTOGRAD_H_
#define PACKD_CLIENT_AUTOGRAD_H_

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace packd {

// Returns x[mask != 0] ([total_active, *tail]) with an autograd edge to `x`.
// The client must outlive the backward pass. Errors of the forward call come
// back as the Status; an error during backward is raised as a c10::Error by
// torch's backward(), as torch reports every backward failure.
absl::StatusOr<at::Tensor> PackWithGrad(Client& client, const at::Tensor& x,
                                        const at::Tensor& mask);

// The same with a layout (docs/design.md §10) and documents: the packed rows
// are the layout's, and backward scatters with the same layout, so x.grad()
// gets each real row's gradient and zeros elsewhere.
absl::StatusOr<at::Tensor> PackWithGrad(Client& client, const at::Tensor& x,
                                        const at::Tensor& mask,
                                        const LayoutOptions& layout,
                                        const at::Tensor& segment_ids = {});

}  // namespace packd

#endif  // PACKD_CLIENT_AUTOGRAD_H_
