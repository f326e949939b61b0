"""Every private name of TRL and transformers that packd's adapters override, call, mirror or
read, each with why, and the releases they are tested against (docs/trl.md, "Compatibility").

packd is exact only while these names mean what they meant in the tested releases.
check() (run when a PackedGRPOTrainer is made) refuses an installed TRL outside TESTED, or one
where a name of NAMES or TRANSFORMERS_NAMES is missing or its parameters changed, naming what
to re-check; PACKD_TRL_UNTESTED=1 turns the version's refusal into a warning (the names are
still checked). check_transformers() (run by register_varlen_attention, for packd.hf's users
without TRL) refuses a missing or changed transformers name and warns for a transformers
outside TESTED_TRANSFORMERS. tests/python/test_trl.py checks both against the pinned stack and
that a faked version or a changed name is named."""
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

# The transformers releases packd's adapters are tested against; python/pyproject.toml's extras
# bound the same range.
TESTED_TRANSFORMERS = ((5, 24), (5, 25))

# transformers' names packd.hf, packd_varlen and the per-document layers touch.
TRANSFORMERS_NAMES: List[Tuple[str, str, Any, str]] = [
    ("transformers", "AttentionInterface", None,
     "register_varlen_attention registers packd_varlen's attention with it"),
    ("transformers.masking_utils", "AttentionMaskInterface", None,
     "register_varlen_attention registers packd_varlen's mask function (VarlenMask) with it"),
    ("transformers.masking_utils", "sdpa_mask",
     ("batch_size", "q_length", "kv_length", "q_offset", "kv_offset", "mask_function",
      "attention_mask"),
     "VarlenMask evaluates the layer's composed mask inside each sequence through it"),
    ("transformers.masking_utils", "causal_mask_function", None,
     "packd_varlen's mask function when transformers hands it none"),
    ("transformers.modeling_utils", "ALL_ATTENTION_FUNCTIONS", None,
     "check_model reads whether an attention module calls the interface (its source names it)"),
    ("transformers.modeling_utils.PreTrainedModel", "set_attn_implementation", ("self",),
     "packd.trl puts every model it serves on packd_varlen"),
    ("transformers.modeling_utils.PreTrainedModel", "_supports_attention_backend", None,
     "check_model: a model that does not declare the attention interface is examined further"),
    ("transformers.configuration_utils.PreTrainedConfig", "_attn_implementation", None,
     "read by the probe's cache key; a layer that picks its keys runs per document under "
     "'eager', set on its config for that call and restored after it"),
    ("transformers.configuration_utils.PreTrainedConfig", "get_text_config", ("self",),
     "the text model's vocabulary, router and head settings"),
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
    try:
        return importlib.import_module(owner)
    except ImportError:
        module, _, attribute = owner.rpartition(".")
        return getattr(importlib.import_module(module), attribute)


def _outside(what: str, installed: str, tested: Tuple[Tuple[int, int], Tuple[int, int]],
             who: str) -> List[str]:
    if tested[0] <= version_of(installed)[:2] < tested[1]:
        return []
    return ["%s %s is outside the releases %s is tested against (>= %s, < %s)"
            % (what, installed, who, ".".join(map(str, tested[0])),
               ".".join(map(str, tested[1])))]


def _changed(names: List[Tuple[str, str, Any, str]]) -> List[str]:
    """Each name missing, or whose leading parameters are not the tested release's."""
    found = []
    for owner, name, parameters, why in names:
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


def transformers_problems() -> List[str]:
    """What of transformers is not as the tested release has it."""
    import transformers
    return (_outside("transformers", transformers.__version__, TESTED_TRANSFORMERS, "packd")
            + _changed(TRANSFORMERS_NAMES))


def problems() -> List[str]:
    """What is not as the tested releases have it: each a line naming what to re-check."""
    import trl
    return (_outside("TRL", trl.__version__, TESTED, "packd.trl") + _changed(NAMES)
            + transformers_problems())


def check_transformers() -> None:
    """RuntimeError naming a transformers name that moved; a warning for an untested
    release."""
    found = transformers_problems()
    for f in [f for f in found if f.startswith("transformers ")]:
        warnings.warn("packd: " + f, RuntimeWarning, stacklevel=3)
    found = [f for f in found if not f.startswith("transformers ")]
    if found:
        raise RuntimeError("packd cannot vouch for this transformers: " + "; ".join(found)
                           + ". Re-check packd/integrations/compat.py's names against it")


def check() -> None:
    """RuntimeError naming every difference from the tested release; with PACKD_TRL_UNTESTED=1
    an untested version alone is a warning."""
    found = problems()
    if found and os.environ.get("PACKD_TRL_UNTESTED") == "1":
        versions = [f for f in found if f.startswith(("TRL ", "transformers "))]
        for f in versions:
            warnings.warn("packd.trl: " + f, RuntimeWarning, stacklevel=3)
        found = [f for f in found if f not in versions]
    if found:
        raise RuntimeError("packd.trl cannot vouch for this TRL: " + "; ".join(found)
                           + ". Re-check packd/integrations/compat.py's names against it, or "
                           "install the tested release (pip install 'packd[trl]')")


def check_attributes(trainer: Any) -> None:
    missing = [a for a in ATTRIBUTES if not hasattr(trainer, a)]
    if missing:
        raise RuntimeError("packd.trl: this TRL's GRPOTrainer no longer sets %s; re-check "
                           "packd/integrations/compat.py against it" % ", ".join(missing))
