"""TRL's fused LM-head kernel's arithmetic in float64, for the float64 proofs of packd.trl
(tests/python/test_trl.py, examples/train_trl_grpo.py --check): trl.kernels.
ChunkedLogProbFunction accumulates in float32 whatever its input, so both trainers of a
comparison use this one instead."""
import torch


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
