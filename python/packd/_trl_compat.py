"""Every private name of TRL and transformers that packd.trl overrides, calls or mirrors, each
with why, and the TRL releases it is tested against (docs/trl.md, "Compatibility").

packd.trl is exact only while these names mean what they meant in the tested release. check()
(run when a PackedGRPOTrainer is made, and by tests/python/test_trl.py) refuses an installed
TRL outside TESTED, or one where a name below is missing or its parameters changed, naming
what to re-check. PACKD_TRL_UNTESTED=1 turns the version's refusal into a warning (the names
are still checked)."""
import inspect
import os
import warnings
from typing import Any, List, Tuple

# The TRL releases packd.trl is tested against (deploy/pypi-constraints.txt pins the newest),
# [lowest, first untested); python/pyproject.toml's extra bounds the same range.
TESTED = ((1, 16), (1, 17))

# (owner, name, parameters or None, why). owner: "GRPOTrainer", "Trainer" (transformers') or a
# module's dotted path. parameters: the leading parameter names the tested release has.
NAMES: List[Tuple[str, str, Any, str]] = [
    ("GRPOTrainer", "_prepare_inputs", ("self", "generation_batch"),
     "overridden: splits the generation batch into packd's micro-batches"),
    ("GRPOTrainer", "_get_per_token_logps_and_entropies",
     ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
      "compute_entropy", "compute_aux_loss"),
     "overridden: the forward through packd; also called as TRL's padded path by the "
     "first-use check"),
    ("GRPOTrainer", "_generate_and_score_completions", ("self", "inputs"),
     "called: generation, rewards, advantages and reference log-probs stay TRL's"),
    ("GRPOTrainer", "_compute_loss", ("self", "model", "inputs"),
     "called by the streaming form on each received micro-batch"),
    ("GRPOTrainer", "training_step", ("self", "model", "inputs", "num_items_in_batch"),
     "overridden by the streaming form"),
    ("GRPOTrainer", "get_high_entropy_mask", ("self", "entropies", "mask", "threshold"),
     "its quantile is per micro-batch: why top_entropy_quantile trains on TRL's slices"),
    ("Trainer", "_clip_grad_norm", ("self", "model"),
     "overridden: a streamed step's gradients scaled before they are clipped"),
    ("Trainer", "_get_grad_norm", ("self", "model", "grad_norm"),
     "overridden: the same scale when nothing is clipped"),
    ("trl.trainer.utils", "shuffle_sequence_dict", ("seq_dict",),
     "mirrored: its torch.randperm draw orders packd's micro-batches (TRL's slices, TRL's RNG)"),
    ("trl.trainer.utils", "split_tensor_dict", ("tensor_dict", "num_chunks"),
     "mirrored: TRL's slices are the draw's rows in steps_per_generation equal parts"),
    ("trl.trainer.utils", "_CHUNKED_LOGPROB_CHUNK_SIZE", None,
     "used: the chunk TRL's fused LM head scores with"),
    ("trl.trainer.utils", "use_adapter", ("model", "adapter_name"),
     "relied on: a PEFT policy's reference runs with its adapters disabled through it"),
    ("trl.kernels", "ChunkedLogProbFunction", None,
     "called: TRL's fused LM head kernel scores the packed rows"),
    ("transformers.models.mixtral.modeling_mixtral", "load_balancing_loss_func",
     ("gate_logits", "num_experts", "top_k", "attention_mask"),
     "called: the MoE load-balancing loss TRL's fused head computes, weighted by each packed "
     "token's rows"),
]

# The GRPOTrainer attributes packd.trl reads, each set by TRL's __init__.
ATTRIBUTES = ("num_generations", "temperature", "beta", "ref_model", "loss_type",
              "top_entropy_quantile", "_entropy_bonus_enabled", "aux_loss_enabled",
              "router_aux_loss_coef", "_buffered_inputs", "_step", "_metrics", "scale_rewards")


def version_of(text: str) -> Tuple[int, ...]:
    return tuple(int(p) for p in text.split("+")[0].split(".")[:3] if p.isdigit())


def _resolve(owner: str) -> Any:
    if owner == "GRPOTrainer":
        from trl import GRPOTrainer
        return GRPOTrainer
    if owner == "Trainer":
        from transformers import Trainer
        return Trainer
    import importlib
    return importlib.import_module(owner)


def problems() -> List[str]:
    """What is not as the tested release has it: each a line naming what to re-check."""
    import trl
    found = []
    version = version_of(trl.__version__)
    if not TESTED[0] <= version[:2] < TESTED[1]:
        found.append("TRL %s is outside the releases packd.trl is tested against (>= %s, < %s)"
                     % (trl.__version__, ".".join(map(str, TESTED[0])),
                        ".".join(map(str, TESTED[1]))))
    for owner, name, parameters, why in NAMES:
        try:
            value = getattr(_resolve(owner), name)
        except (ImportError, AttributeError):
            found.append("%s.%s is missing (%s)" % (owner, name, why))
            continue
        if parameters is None:
            continue
        have = tuple(inspect.signature(value).parameters)[:len(parameters)]
        if have != tuple(parameters):
            found.append("%s.%s takes %s, not %s (%s)" % (owner, name, have, parameters, why))
    return found


def check() -> None:
    """RuntimeError naming every difference from the tested release; with PACKD_TRL_UNTESTED=1
    an untested version alone is a warning."""
    found = problems()
    if found and os.environ.get("PACKD_TRL_UNTESTED") == "1":
        versions = [f for f in found if f.startswith("TRL ")]
        for f in versions:
            warnings.warn("packd.trl: " + f, RuntimeWarning, stacklevel=3)
        found = [f for f in found if f not in versions]
    if found:
        raise RuntimeError("packd.trl cannot vouch for this TRL: " + "; ".join(found)
                           + ". Re-check packd/_trl_compat.py's names against it, or install "
                           "the tested release (pip install 'packd[trl]')")


def check_attributes(trainer: Any) -> None:
    missing = [a for a in ATTRIBUTES if not hasattr(trainer, a)]
    if missing:
        raise RuntimeError("packd.trl: this TRL's GRPOTrainer no longer sets %s; re-check "
                           "packd/_trl_compat.py against it" % ", ".join(missing))
