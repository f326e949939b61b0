"""What packd checks of a model before it trains packed, by its structure (the leak probe,
packd.integrations.probe, checks what it computes): check_model refuses a family packd_varlen
cannot serve, naming why; position_offset says where its embeddings number a document's
positions from."""
import inspect
from typing import Dict, Optional, Tuple

import torch

from packd.integrations.stateful import STATEFUL, stateful_layers

# transformers' layer types whose layers mix tokens through the attention function alone.
_ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Layer types that mix no tokens (a hybrid's feed-forward blocks).
_PER_TOKEN_LAYERS = frozenset({"mlp", "moe"})


def position_offset(model: torch.nn.Module) -> int:
    """Where the model's embeddings number a sequence's positions from: padding_idx + 1 for
    those that do so (RoBERTa and its kin), else 0."""
    for sub in model.modules():
        if (hasattr(sub, "position_embeddings") and isinstance(getattr(sub, "padding_idx", None),
                                                                int)):
            return sub.padding_idx + 1
    return 0


def check_model(model: torch.nn.Module, offset_positions: bool = False) -> None:
    """Refuses (ValueError naming the family) a model packd_varlen cannot train packed: one
    with layer types other than full, sliding or chunked attention that packd does not run per
    document (packd/integrations/stateful.py; any other layer that mixes tokens would see across
    documents), whose forward takes no position ids
    (its positions could not restart at every document), whose attention modules do not call
    transformers' attention interface (packd_varlen may never be called: the model declares
    it, else each module's source reads it), or, unless `offset_positions`
    (the caller adds position_offset(model) to the position ids: packed_row does), whose
    embeddings number positions from after the pad id (a document's first position is not 0)."""
    config = getattr(model, "config", None)
    kind = "%s (%s)" % (type(model).__name__, getattr(config, "model_type", "?"))
    configs = [config] + [v for v in vars(config).values()
                          if type(v).__name__.endswith("Config")] if config is not None else []
    stateful = len(stateful_layers(model))
    attention = stateful == 0
    for c in configs:
        types = [t for t in (getattr(c, "layer_types", None) or [])
                 if t not in _ATTENTION_LAYERS and t not in _PER_TOKEN_LAYERS]
        attention = attention or any(t in _ATTENTION_LAYERS
                                     for t in (getattr(c, "layer_types", None) or []))
        if types and len(types) > stateful:
            raise ValueError("packd_varlen cannot serve %s: its layer types %s are not an "
                             "attention packd_varlen computes nor a layer packd runs per "
                             "document (gated delta nets, Mamba mixers, short "
                             "convolutions, lightning and delta attention, recurrent blocks, "
                             "attention with an indexer, compressor, convolution or relative "
                             "logits), "
                             "and would see across documents"
                             % (kind, ", ".join(sorted(set(types)))))
    unknown = _unknown_state(model)
    if unknown:
        raise ValueError("packd_varlen cannot serve %s: %s carries state across tokens (%s) and "
                         "is no layer packd runs per document, so it would "
                         "carry it from one document into the next" % ((kind,) + unknown))
    if attention and "position_ids" not in inspect.signature(model.forward).parameters:
        raise ValueError("packd_varlen cannot serve %s: its forward takes no position_ids, so "
                         "its positions cannot restart at every document" % kind)
    for sub in model.modules():
        if (hasattr(sub, "config") and hasattr(type(sub), "_supports_attention_backend")
                and not type(sub)._supports_attention_backend
                and not _interfaced(model, stateful)):
            raise ValueError("packd_varlen cannot serve %s: %s does not declare transformers' "
                             "attention interface (_supports_attention_backend is False) and "
                             "its attention modules do not all call it, so packd_varlen may "
                             "never be called and its documents would attend to each other"
                             % (kind, type(sub).__name__))
    offset = position_offset(model)
    if offset and not offset_positions:
        raise ValueError("packd_varlen cannot serve %s here: its embeddings number a sequence's "
                         "positions from padding_idx + 1 = %d, not 0, so packd's position ids "
                         "(0 at every document) are not its own; packd.hf.packed_row(r, model) "
                         "gives them from %d" % (kind, offset, offset))


def _unknown_state(model: torch.nn.Module) -> Optional[Tuple[str, str]]:
    """The first module that carries state across tokens by its structure, outside the layers
    packd runs per document (and outside vision and audio towers): a causal convolution over
    tokens (a Conv1d padded by its kernel less one), or the innermost module whose forward takes
    a recurrent cache (`cache_params`) with no layer packd knows inside it (a block or a model
    that hands the cache on to one is not it). (its name, why), or None."""
    covered = {id(m) for _, layer in stateful_layers(model) for m in layer.modules()}
    takes: Dict[type, bool] = {}

    def takes_cache(module: torch.nn.Module) -> bool:
        if type(module) not in takes:
            try:
                parameters = inspect.signature(type(module).forward).parameters
            except (TypeError, ValueError):
                parameters = {}
            takes[type(module)] = "cache_params" in parameters
        return takes[type(module)]

    # Whether a module's children hold a known layer or a cache taker.
    module_below: Dict[int, bool] = {}

    def visit(module: torch.nn.Module) -> bool:
        below = False
        for child in module.children():
            below = visit(child) or below
        module_below[id(module)] = below
        return below or id(module) in covered or takes_cache(module)

    visit(model)
    for name, module in model.named_modules():
        if id(module) in covered or any(t in name.lower() for t in ("vision", "audio")):
            continue
        if isinstance(module, torch.nn.Conv1d):
            kernel, padding = module.kernel_size[0], module.padding
            if kernel > 1 and not isinstance(padding, str) and padding[0] == kernel - 1:
                return "%s (%s)" % (name, type(module).__name__), "a causal convolution"
        elif takes_cache(module) and not module_below[id(module)]:
            return "%s (%s)" % (name or "the model", type(module).__name__), (
                "its forward takes cache_params")
    return None


def _interfaced(model: torch.nn.Module, stateful: int) -> bool:
    """Whether every attention module of a model (a class named *Attention that packd does not
    run per document) calls transformers' attention interface, though the model does not
    declare it (transformers' hybrid families do not, nor BioGPT and StableLM); a model with no
    such module, only when it has `stateful` layers packd runs per document."""
    classes = {type(m) for m in model.modules()
               if type(m).__name__.endswith("Attention") and not STATEFUL.search(type(m).__name__)}
    if not classes:
        return stateful > 0
    for cls in classes:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            return False
        if "ALL_ATTENTION_FUNCTIONS" not in source:
            return False
    return True
