"""Every causal-LM model type of the installed transformers at a tiny size, as the survey
(test_survey.py) builds it: the type's default config with its sizes made small (2 or 3 layers,
one of each layer type it mixes; hidden 32; 4 heads over 2; vocabulary 128; sliding windows and
attention chunks of 4 tokens, shorter than the survey's documents), from its config class
alone: random weights, no download."""
import re
import warnings

import torch

try:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # Debian's stack: test_survey.py skips, saying so
    transformers = None
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = {}

VOCAB = 128
WINDOW = 4  # sliding windows and attention chunks, in tokens

# Sizes set to exactly these values wherever a config has them.
EXACT = {
    "vocab_size": VOCAB, "unpadded_vocab_size": VOCAB, "num_attention_heads": 4, "n_head": 4,
    "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
    "n_positions": 128, "n_ctx": 128, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2,
    "n_shared_experts": 1, "kv_lora_rank": 8, "q_lora_rank": 8, "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4, "v_head_dim": 8, "sliding_window": WINDOW,
    "attention_chunk_size": WINDOW, "rotary_dim": 4}
# Per type, what the generic shrinking misses: layer-type lists that keep a layer of each kind,
# the sub-module shapes of Mamba 2 mixers (heads x head size = expand x hidden) and of routers
# (no more experts per token than experts), and indexers that choose.
RULES = {
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 16,
               "chunk_size": 64},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
              "mamba_chunk_size": 64},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                         "mamba_chunk_size": 64},
    "zamba2": {"n_mamba_heads": 4, "mamba_headdim": 16, "mamba_d_state": 16,
               "attention_head_dim": 8, "num_query_groups": 4, "chunk_size": 64},
    # Mamba 2 scans in chunks of 64 (documents of 63, 64 and 65 tokens straddle them), which
    # also bounds the reference scan's [chunk, chunk] blocks.
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64,
                  "mamba_d_state": 16, "mamba_chunk_size": 64},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 1, "chunk_size": 64},
    "kimi_linear": {"num_experts_per_token": 2, "linear_num_heads": 4, "linear_head_dim": 8},
    # Multi-head latent attention: the rotary part's width is head_dim, a head's query and key
    # nope + rope; expert groups that divide the experts.
    "deepseek_v3": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "youtu": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "axk1": {"head_dim": 4, "qk_head_dim": 8, "n_group": 1, "topk_group": 1},
    "deepseek_v2": {"qk_head_dim": 8, "num_experts_per_tok": 2},
    # Defaults left to be derived (None): given.
    "hunyuan_v1_dense": {"head_dim": 8}, "hunyuan_v1_moe": {"head_dim": 8},
    "ministral": {"head_dim": 8}, "nemotron": {"num_key_value_heads": 2},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "plbart": {"encoder_attention_heads": 4, "decoder_attention_heads": 4},
    "whisper": {"encoder_attention_heads": 4, "decoder_attention_heads": 4},
    "reformer": {"is_decoder": True},
    "beam": {"n_group": 1, "topk_group": 1},
    "bailing_hybrid": {"num_expert_group": 1, "topk_group": 1, "num_experts_per_token": 2},
    # An indexer that picks fewer keys than a document has: its top-k choice is exercised; GLM
    # DSA's and HY v4's second layer reuses the first's choice (handed on between the layers).
    "deepseek_v32": {"index_topk": 4},
    "glm_moe_dsa": {"index_topk": 4, "indexer_types": ["full", "shared"]},
    "hy_v4": {"index_topk": 4, "indexer_types": ["full", "shared"]},
    "axk2": {"index_topk": 4}, "dots3_note_text": {"index_topk": 4},
    # Compressed keys: blocks of 4 tokens (picked by the indexer) and of 16, fewer tokens
    # than the documents have.
    "deepseek_v4": {"index_topk": 4, "compress_rates": {"compressed_sparse_attention": 4,
                                                         "heavily_compressed_attention": 16}},
    # Settings left undefined (None) or inconsistent by the defaults: given.
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "cohere_compass_text": {"rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0}
        for t in ("full_attention", "sliding_attention")}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8,
                       "indexer_budget": 8, "indexer_compress_ratio": 2},
    # RoBERTa and its kin as the causal LMs their *ForCausalLM classes are (bidirectional by
    # default).
    **{kind: {"is_decoder": True} for kind in (
        "roberta", "camembert", "xlm-roberta", "xlm-roberta-xl", "data2vec-text",
        "roberta-prelayernorm")},
    "xmod": {"default_language": "en_XX", "is_decoder": True},
    "gemma3n_text": {"num_kv_shared_layers": 0},
    "gemma4_assistant": {"text_config": {
        "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "enable_moe_block": False, "use_double_wide_mlp": False}},
    # One codebook: a row of tokens is one sequence.
    "musicgen_decoder": {"num_codebooks": 1}, "musicgen_melody_decoder": {"num_codebooks": 1},
    "longcat_flash": {"qk_head_dim": 8, "head_dim": 4},
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
}
LAYERS = r"(num_hidden_layers|n_layers?|num_layers|decoder_layers|encoder_layers|depth)"
WIDTH = r"(hidden_size|n_embd|d_model|embed_dim|hidden_dim|dim)$"
INNER = r"(intermediate|ffn|d_ff|n_inner|mlp)"


def causal_lm_types():
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _kept_layers(values):
    """The layers kept: the first of each layer type (at most 3), else the first two."""
    n = next((values[k] for k in ("num_hidden_layers", "n_layer", "num_layers")
              if isinstance(values.get(k), int)), None)
    types = values.get("layer_types")
    if isinstance(types, (list, tuple)) and n and len(types) == n:
        keep = []
        for i, t in enumerate(types):
            if t not in [types[j] for j in keep]:
                keep.append(i)
        return n, (keep[:3] if len(keep) > 1 else list(range(min(n, 2))))
    return n, (list(range(2)) if n and n > 2 else None)


def _per_layer(name, value, mla):
    """A per-layer override's small value."""
    if name in ("head_dim", "num_attention_heads") or (name == "num_key_value_heads" and mla):
        return 2 * EXACT[name if name != "num_key_value_heads" else "num_attention_heads"]
    if name in EXACT and isinstance(value, int):
        return EXACT[name]
    if isinstance(value, int) and re.search(WIDTH, name):
        return min(value, 32)
    return value


def _small(config):
    """Keyword arguments that make `config`'s class small (sub-configs made small as dicts)."""
    values = {k: v for k, v in vars(config).items() if not k.startswith("_")}
    n, keep = _kept_layers(values)
    out = {}
    for k, v in values.items():
        if isinstance(v, PretrainedConfig):
            out[k] = {**v.to_dict(), **_small(v)}
        elif (isinstance(v, (list, tuple)) and keep is not None and len(v) == n
              and k not in ("architectures",)):
            out[k] = [v[i] for i in keep]
        elif isinstance(v, int) and not isinstance(v, bool):
            new = None
            if k in EXACT:
                new = EXACT[k]
            elif re.fullmatch(LAYERS, k):
                new = len(keep) if keep is not None and v == n else min(v, 2)
            elif re.search(WIDTH, k) and v > 32:
                new = 32
            elif re.search(INNER, k) and v > 64:
                new = 64
            if new is not None and new != v:
                out[k] = new
    layers = config.to_dict().get("per_layer_config") if "num_hidden_layers" in values else None
    if isinstance(layers, dict) and keep is not None:
        # Per-layer overrides, keyed by layer index: those of the kept layers, re-indexed, made
        # small as the others, the head sizes and counts twice the others' so that they stay
        # per layer.
        mla = "kv_lora_rank" in values
        out["per_layer_config"] = {
            "%0*d" % (len(k), keep.index(int(k))): {
                name: _per_layer(name, value, mla) for name, value in v.items()}
            for k, v in layers.items() if k.isdigit() and int(k) in keep}
    if "vocab_size_per_layer_input" in values:  # Gemma's per-layer token embeddings
        out["vocab_size_per_layer_input"] = VOCAB
        out["hidden_size_per_layer_input"] = 8
    if "kv_lora_rank" in values:  # multi-head latent attention: as many key heads as query
        out["num_key_value_heads"] = EXACT["num_attention_heads"]
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(values.get(token), int) and values[token] >= VOCAB:
            out[token] = 0
    for k, v in RULES.get(getattr(config, "model_type", None), {}).items():
        if k in values:  # a sub-config's rule: merged into its small form
            out[k] = {**out[k], **v} if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def _set_small(config, seen):
    """The same sizes set on a built config in place (for classes whose constructor refuses
    the keyword form)."""
    if id(config) in seen:
        return
    seen.add(id(config))
    small = _small(config)
    for k, v in small.items():
        sub = getattr(config, k, None)
        if isinstance(sub, PretrainedConfig):
            _set_small(sub, seen)
            continue
        try:
            setattr(config, k, v)
        except Exception:  # a read-only property: left as it is
            pass


def tiny_model(model_type, attn_implementation):
    """The type's causal LM at a tiny size in float64 (every parameter and buffer, the modules
    the family keeps in float32 too), eval mode: its config class's defaults, made small by
    keyword (or, where the class refuses that, in place)."""
    default = _default_config(model_type)
    errors = []
    for make in (lambda: type(default)(**{**default.to_dict(), **_small(default)}),
                 lambda: _in_place(_default_config(model_type))):
        try:
            config = make()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # The mapped class itself: a composite type's causal LM may take its decoder's
                # config, which AutoModelForCausalLM does not map (Musicgen).
                cls = _causal_lm_class(model_type)
                build = cls._from_config if cls else AutoModelForCausalLM.from_config
                model = build(config, attn_implementation=attn_implementation,
                              experts_implementation="eager", dtype=torch.float64)
            _hash_routes(model)
            return model.double().eval()  # the modules kept in float32 too
        except Exception as e:  # the next way, or the reason it cannot be built
            errors.append(e)
    raise errors[-1]


def _hash_routes(model):
    """A hash router's table of experts per token id (DeepSeek V4's first layers) is a
    checkpoint's, zeros when built: every token would pick expert 0 for each of its slots, and
    the router's weight would get a gradient of zero up to rounding. Distinct random experts
    per token instead."""
    for module in model.modules():
        table = getattr(module, "tid2eid", None)
        if isinstance(table, torch.Tensor) and table.dim() == 2:
            experts = getattr(module, "num_experts", table.shape[1])
            table.copy_(torch.stack([torch.randperm(experts)[:table.shape[1]]
                                     for _ in range(table.shape[0])]))


def _causal_lm_class(model_type):
    """The type's causal-LM class in transformers' mapping (None for a type outside it)."""
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    return getattr(transformers, name, None) if name else None


def _default_config(model_type):
    """The default config of the type's causal LM: its model class's config class (a composite
    type's causal LM may be its decoder alone: Musicgen), else the type's; where the defaults
    do not validate, with the type's rules given."""
    config_class = getattr(_causal_lm_class(model_type), "config_class", None)
    make = config_class or (lambda **kwargs: AutoConfig.for_model(model_type, **kwargs))
    try:
        return make()
    except Exception:  # defaults that do not validate: the rules first
        return make(**RULES.get(model_type, {}))


def _in_place(config):
    _set_small(config, set())
    return config


def logits_of(output):
    return output.logits if hasattr(output, "logits") else output[0]


def logits_and_grads(model, weights, **call):
    """The model's logits of one row and every trainable parameter's gradient of the weighted
    sum (weights [tokens, vocabulary]); zeros for a parameter the row does not reach."""
    logits = logits_of(model(**call))[0]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((logits * weights).sum(), params, allow_unused=True)
    return logits.detach(), [torch.zeros_like(p) if g is None else g
                             for g, p in zip(grads, params)]


def packed_and_alone(packed, alone, result, documents, weights):
    """(logits, gradients) of `packed` on a Pack's row of the documents (packd.hf.packed_row),
    and of `alone` on each document by itself (logits in order, gradients summed)."""
    from packd.hf import packed_row
    with packed_row(result, packed) as kwargs:
        got = logits_and_grads(packed, weights, input_ids=result.packed[0][None], **kwargs)
    want, want_grads, start = [], None, 0
    for d in documents:
        logits, grads = logits_and_grads(alone, weights[start:start + len(d)],
                                         input_ids=torch.tensor(d)[None], use_cache=False)
        want.append(logits)
        want_grads = grads if want_grads is None else [a + b for a, b in zip(want_grads, grads)]
        start += len(d)
    return got, (torch.cat(want), want_grads)
