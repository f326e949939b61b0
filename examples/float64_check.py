"""Float64 comparisons of a packed model against its padded run, as the examples' `--check`
and packd's tests make them: the float32 steps transformers and TRL take whatever the model's
dtype (eager attention's softmax, RMSNorm, Mixtral's router, casts of a float64 tensor to
float32, TRL's fused LM-head kernel's accumulators) kept in float64 with the same formulas, so
that a float64 model is float64 through and through and both ways of a comparison compute the
same arithmetic. Only torch and transformers are needed (no test runner)."""
import contextlib
import importlib

import torch


def keep_float64(monkeypatch, modules):
    """Eager attention's softmax (softmax(..., dtype=torch.float32), as a function or a
    tensor's method), every RMSNorm of the
    families' modeling modules `modules` (Llama's casts its input to float32, Gemma's input and
    weight) and Mixtral's router (which casts its logits) kept in float64 for float64 inputs.
    Otherwise a float64 reference differs by 4e-8 to 1e-7: a norm weight's gradient summed in
    float32 in the order of the tokens, a shared prompt's gradient summed over its members
    before those steps in a stream and after them in a padded batch."""
    softmax = torch.nn.functional.softmax

    def in_float64(x, dim=None, _stacklevel=3, dtype=None):
        return softmax(x, dim=dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.nn.functional, "softmax", in_float64)
    method = torch.Tensor.softmax

    def method_in_float64(x, dim, dtype=None):  # DeepSeek V4's compressor: x.softmax(dim, dtype)
        return method(x, dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    monkeypatch.setattr(torch.Tensor, "softmax", method_in_float64)

    def llama(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) +
                                              self.variance_epsilon))

    def gemma(self, x):
        return self._norm(x) * (1.0 + self.weight)

    def router(self, hidden_states):
        logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim),
                                            self.weight)
        top, indices = torch.topk(torch.nn.functional.softmax(logits, dim=-1), self.top_k,
                                  dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), indices

    for family in modules:
        module = importlib.import_module("transformers.models.%s.modeling_%s"
                                         % (family, family))
        for name in dir(module):
            if name.endswith("RMSNorm"):
                monkeypatch.setattr(getattr(module, name), "forward",
                                    gemma if family.startswith("gemma") else llama)
            if name == "MixtralTopKRouter":
                monkeypatch.setattr(getattr(module, name), "forward", router)


class Float64Steps:
    """`kept()`: while open, the float32 steps transformers takes whatever the model's dtype
    (norms, rotary and scores cast to float32) stay in float64 for float64 tensors: a float64
    tensor's .float(), .to(torch.float32) and .type(torch.float32) are itself, and
    torch.zeros_like(it, dtype=torch.float32) is float64. For a model that
    is float64 through (its float32 modules made float64 too), both ways of a comparison run
    under it; the softmax is keep_float64's."""

    @contextlib.contextmanager
    def kept(self, on=True):
        to, as_float, as_type = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type

        def keep_to(tensor, *args, **kwargs):
            target = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)),
                                              None))
            if tensor.dtype == torch.float64 and target == torch.float32:
                kwargs.pop("dtype", None)
                args = tuple(a for a in args if not isinstance(a, torch.dtype))
                if kwargs.get("device") is None and all(a is None or isinstance(a, bool)
                                                        for a in args):
                    return tensor  # nothing left to do (nn.Module.to passes device None)
                return to(tensor, *args, **kwargs)
            return to(tensor, *args, **kwargs)

        def keep_float(tensor, *args, **kwargs):
            return tensor if tensor.dtype == torch.float64 else as_float(tensor, *args, **kwargs)

        def keep_type(tensor, *args, **kwargs):
            if tensor.dtype == torch.float64 and args and args[0] == torch.float32:
                return tensor
            return as_type(tensor, *args, **kwargs)

        zeros_like = torch.zeros_like

        def keep_zeros_like(tensor, *args, **kwargs):  # a float32 accumulator (Inkling 2's)
            if tensor.dtype == torch.float64 and kwargs.get("dtype") == torch.float32:
                kwargs["dtype"] = torch.float64
            return zeros_like(tensor, *args, **kwargs)

        if on:
            torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = (keep_to, keep_float,
                                                                      keep_type)
            torch.zeros_like = keep_zeros_like
        try:
            yield
        finally:
            torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, as_float, as_type
            torch.zeros_like = zeros_like


class ExactLogProb:
    """TRL's fused LM-head kernel's arithmetic (trl.kernels.ChunkedLogProbFunction: projection,
    logit scale, soft-capping, temperature, log-softmax at the targets, entropy) in the inputs'
    dtype, without its float32 accumulators."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, scale=1.0,
              outputs=("log_probs",)):
        logits = hidden @ weight.t()
        if bias is not None:
            logits = logits + bias
        logits = logits * scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logp = torch.log_softmax(logits / temperature, dim=-1)
        picked = logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return picked, entropy, None, None, None
