"""TRL's GRPOTrainer on packd (docs/trl.md): the same loss and gradients, prompts forwarded once.

    from packd.trl import PackedGRPOTrainer        # instead of trl.GRPOTrainer
    trainer = PackedGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, packd_client=packd.Client(address))
    trainer.train()

What changes, and nothing else:
- **Micro-batches.** TRL shuffles a generation batch's rows and slices it into
  `steps_per_generation` micro-batches of equal row counts. Here, where every statistic TRL
  takes per micro-batch is one of its row count, each micro-batch is whole groups instead (the
  same number of groups in each, so TRL's rows, placed to even out their tokens), so that a
  group's responses share its prompt. Where TRL takes a statistic of the micro-batch's tokens
  (bnpo's token count, the entropy mask's quantile, the entropy bonus's mean, a MoE model's
  load-balancing loss), where optimizer steps fall inside a generation batch, or where the
  groups do not divide into whole-group micro-batches, the micro-batches are TRL's own slices
  (TRL's draw), each group's rows within a slice sharing their prompt (`micro_batches`).
  The Trainer still runs exactly `gradient_accumulation_steps` forwards per optimizer step.
- **The forward through packd.** Each micro-batch's padded rows (prompts left-padded,
  completions right-padded) are packed by packd: with `share_prompt` (the default) each group's
  prompt once and its responses as its continuations (DESIGN §14), else one document per row.
  Every model TRL scores through the log-prob hook runs the packed stream with
  `attn_implementation="packd_varlen"` and per-document state: the policy, the reference model
  (`beta > 0`) and a PEFT policy with its adapters disabled. The per-token log-probs and
  entropies of the completion tokens come back in TRL's `(B, C)` shape, computed by TRL's own
  fused LM head kernel on the rows that predict them; a MoE model's load-balancing loss is
  TRL's, each packed token weighted by the rows that hold it. TRL's `_compute_loss` then runs
  unchanged.
- **Checked at first use.** The first time each model runs packed (and every `check_every`
  optimizer steps), its log-probs and entropies are computed again through TRL's own padded
  path and compared; a difference beyond the dtype's tolerance raises, naming the model.

- **Several ranks.** With several processes (accelerate's DDP) and whole-group micro-batches,
  each generation batch is gathered on every rank and its groups placed on the ranks, the same
  number of whole groups on each, evened out by tokens; each rank then splits its own groups as
  above. Every rank runs the same number of forwards, none of them empty.

- **Streaming** (streaming=Streaming(rollout, ...)): rollout workers in their own processes
  score each group and submit it to a streaming step as soon as it is scored; every rank
  trains the micro-batches packd sends it inside one training_step, each one's summed token
  loss backpropagated, and _clip_grad_norm first scales the gradients by the step's global
  token count (packd/integrations/trl_stream.py).

Refused by name: vision-language inputs, `use_liger_kernel`, and in the streaming form the
settings it cannot honour (trl_stream.check_streaming). The private TRL names this relies on
are listed, and checked, in packd/integrations/compat.py."""
import collections
import contextlib
import time
from typing import Any, Deque, Dict, List, Optional, Sequence

import torch

import packd
from packd.integrations import compat as _trl_compat
from packd.integrations import trl_stream as _stream
from packd.integrations.checks import check_model
from packd.integrations.hf import probe_model, register_varlen_attention, shared_attention_kwargs
from packd.integrations.stateful import bound_states
from packd.integrations.trl_stream import Policy, ScoredGroup, Streaming
from packd.layout import Layout, SharedPrefix

try:
    import trl.kernels as _kernels
    from trl import GRPOTrainer
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as _CHUNK
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("packd.trl needs TRL: pip install 'packd[trl]'") from e

__all__ = ["PackedGRPOTrainer", "PackedPathDiffers", "Policy", "ScoredGroup", "Streaming",
           "CHECK_TOLERANCE", "whole_group_parts"]

# The first-use check's tolerance: the largest difference of a log-prob (or entropy) between the
# packed forward and TRL's padded one, by the model's dtype (check_tolerance= overrides it). A
# leak across documents moves log-probs by tenths; kernels' rounding by far less.
CHECK_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-3, torch.bfloat16: 0.25,
                   torch.float16: 0.1}
MICRO_BATCHES = ("auto", "groups", "trl")

# The keyword arguments of _get_per_token_logps_and_entropies that carry images or tiles.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
               "mm_token_type_ids", "image_position_ids")


def _head_scales(model: torch.nn.Module):
    """The final logit soft-capping and logit scale TRL's fused LM head applies
    (trl.trainer.utils.add_fused_lm_head), read from the model's text config the same way."""
    text = model.config.get_text_config()
    softcap = getattr(text, "final_logit_softcapping", None)
    scale = getattr(text, "logit_scale", None)
    if scale is None:
        scale = getattr(text, "output_multiplier", None)
    if scale is None:
        scale = getattr(text, "lm_head_multiplier", None)
    if scale is None and getattr(text, "logits_scaling", None) is not None:
        scaling = text.logits_scaling
        scale = scaling if text.model_type == "hyperclovax" else 1 / scaling
    return softcap, 1.0 if scale is None else scale


def _take(batch: Dict[str, Any], rows: List[int]) -> Dict[str, Any]:
    """Rows `rows` of a generation batch, as TRL's split_tensor_dict slices it (0-dim tensors
    and None kept whole)."""
    index = torch.tensor(rows, dtype=torch.long)
    out = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            out[key] = value[index.to(value.device)]
        else:
            out[key] = [value[i] for i in rows]
    return out


def _gathered(accelerator: Any, batch: Dict[str, Any]) -> Dict[str, Any]:
    """Every process's rows of a generation batch, in process order, on every process: per-row
    tensors gathered (those of two dimensions first padded to the widest process's: prompts on
    the left, as TRL pads them, the rest on the right), lists gathered as objects, 0-dim tensors
    (TRL's global counts) and None kept."""
    from accelerate.utils import gather_object
    out = {}
    for key, value in batch.items():
        if value is None or (isinstance(value, torch.Tensor) and value.ndim == 0):
            out[key] = value
        elif isinstance(value, torch.Tensor):
            if value.ndim == 2:
                value = accelerator.pad_across_processes(value, dim=1,
                                                         pad_first=key.startswith("prompt_"))
            out[key] = accelerator.gather(value.contiguous())
        elif isinstance(value, list):
            out[key] = gather_object(value)
        else:
            raise ValueError("packd.trl: the generation batch's %r (a %s) is not gathered across "
                             "processes" % (key, type(value).__name__))
    return out


def whole_group_parts(tokens: Sequence[int], group: int, parts: int,
                      order: Optional[Sequence[int]] = None) -> List[List[int]]:
    """Rows of groups of `group` consecutive rows (tokens: each row's), in `parts` parts of the
    same number of whole groups each, placed largest group first (ties in `order`, a
    permutation of the rows: a group's place is its first row's) into the part with the fewest
    tokens so far; each part's rows in batch order. ValueError when the groups do not divide
    into `parts` equal counts."""
    rows = len(tokens)
    if group <= 0 or rows % group:
        raise ValueError("packd.trl: %d rows are not whole groups of num_generations = %d"
                         % (rows, group))
    groups = rows // group
    if groups % parts:
        raise ValueError(
            "packd.trl: a generation batch of %d groups does not split into steps_per_generation"
            " = %d micro-batches of whole groups: make the groups per generation batch "
            "(generation_batch_size / num_generations) a multiple of steps_per_generation"
            % (groups, parts))
    per_part = groups // parts
    sizes = [sum(tokens[g * group:(g + 1) * group]) for g in range(groups)]
    rank = list(range(groups))
    if order is not None:
        seen = []
        for row in order:
            if row // group not in seen:
                seen.append(row // group)
        rank = [seen.index(g) for g in range(groups)]
    load, members = [0] * parts, [[] for _ in range(parts)]
    for g in sorted(range(groups), key=lambda g: (-sizes[g], rank[g])):
        p = min((p for p in range(parts) if len(members[p]) < per_part), key=lambda p: load[p])
        members[p].append(g)
        load[p] += sizes[g]
    return [[g * group + k for g in sorted(m) for k in range(group)] for m in members]


def _refuse_settings(config: Any) -> None:
    """ValueError naming each GRPOConfig setting packd.trl cannot serve, before TRL builds
    anything."""
    if getattr(config, "use_liger_kernel", False):
        raise ValueError("packd.trl: use_liger_kernel: Liger's fused loss takes the padded "
                         "batch's hidden states, which a packed stream does not have; packd "
                         "scores the packed rows with TRL's own fused LM head instead")


class PackedPathDiffers(RuntimeError):
    """The first-use check found a model's packed log-probs other than TRL's padded ones."""


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model that takes position_ids: a PEFT wrapper's base model, else the model."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(model, "peft_config") else model


def _adapters_disabled(model: torch.nn.Module) -> bool:
    """Whether a PEFT model's adapter layers are disabled now (TRL's use_adapter(model, None):
    the reference of a policy trained with LoRA)."""
    if not hasattr(model, "peft_config"):
        return False
    for module in model.modules():
        disabled = getattr(module, "disable_adapters", None)
        if isinstance(disabled, bool) and hasattr(module, "active_adapters"):
            return disabled
    return False


def _by_prompt(batch: Dict[str, Any], rows: Sequence[int]) -> List[int]:
    """`rows` with the rows of one prompt made consecutive (each prompt where its first row is),
    so that packing shares each prompt once."""
    ids, mask = batch["prompt_ids"], batch["prompt_mask"].bool()
    order: Dict[Any, List[int]] = {}
    for row in rows:
        order.setdefault(tuple(ids[row][mask[row]].tolist()), []).append(row)
    return [row for members in order.values() for row in members]


def _row_keys(result: Any) -> List[torch.Tensor]:
    """Each padded row's stream rows, in row order: the keys of its last segment (a group's
    prompt, then the row's own completion)."""
    s = result.shared
    last: Dict[int, int] = {}
    for n, row in enumerate(s.segment_row.tolist()):
        last[row] = n
    cu_k = s.cu_seqlens_k.tolist()
    return [s.kv_index[cu_k[last[b]]:cu_k[last[b] + 1]].long() for b in sorted(last)]


def token_rows(result: Any) -> torch.Tensor:
    """How many of the padded rows hold each row of a shared stream (a group's prompt: its
    members'; a completion token: 1)."""
    return torch.bincount(torch.cat(_row_keys(result)), minlength=int(result.total_active))


def _padded_rows(result: Any, completion_width: int):
    """A shared stream's rows as TRL pads them (prompts on the left, completions on the right
    to completion_width): (input_ids, attention_mask). Row b's tokens are the keys of its last
    segment, its completion the last of them (one per target)."""
    targets = result.shared.target_cu_seqlens.tolist()
    prompts, completions = [], []
    for b, keys in enumerate(_row_keys(result)):
        tokens = result.packed[0][keys]
        c = targets[b + 1] - targets[b]
        prompts.append(tokens[:len(tokens) - c])
        completions.append(tokens[len(tokens) - c:])
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width + completion_width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, width - len(p):width], mask[b, width - len(p):width] = p, 1
        ids[b, width:width + len(c)], mask[b, width:width + len(c)] = c, 1
    return ids, mask


class PackedGRPOTrainer(GRPOTrainer):
    """trl.GRPOTrainer whose micro-batches' forward runs packed through packd (the module's
    docstring). Takes every argument GRPOTrainer takes, and:
    packd_client (a packd.Client; default: one to packd_address, "127.0.0.1:50051" unless
    given); share_prompt (each group's prompt once; default True); micro_batches ("auto", the
    default: whole groups where TRL's statistics allow, else TRL's own slices; "groups" or
    "trl" to insist: "groups" is refused where it would change the loss); check_packed (the
    first-use check, default True), check_every (also every N optimizer steps; 0: first use
    only), check_tolerance (a number, or a dict by dtype; default CHECK_TOLERANCE); leak_probe
    (packd.hf.probe_model on each model served, once per family; default True); streaming
    (a packd.trl.Streaming: train from streaming steps fed by rollout workers; docs/trl.md,
    "Streaming"). accept_bnpo_difference is accepted and has no effect (bnpo is TRL's value
    now)."""

    def __init__(self, *args: Any, packd_client: Optional[packd.Client] = None,
                 packd_address: str = "127.0.0.1:50051", share_prompt: bool = True,
                 micro_batches: str = "auto", check_packed: bool = True, check_every: int = 0,
                 check_tolerance: Any = None, leak_probe: bool = True,
                 accept_bnpo_difference: bool = False, streaming: Optional[Streaming] = None,
                 **kwargs: Any) -> None:
        _trl_compat.check()  # a TRL whose private names moved is refused before anything runs
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if micro_batches not in MICRO_BATCHES:
            raise ValueError("packd.trl: micro_batches is one of %s, not %r"
                             % (", ".join(MICRO_BATCHES), micro_batches))
        if config is not None:
            _refuse_settings(config)
        if streaming is not None and config is not None:
            _stream.check_streaming(config, share_prompt)
        register_varlen_attention()
        super().__init__(*args, **kwargs)
        _trl_compat.check_attributes(self)
        if config is None:  # TRL's default configuration
            _refuse_settings(self.args)
            if streaming is not None:
                _stream.check_streaming(self.args, share_prompt)
        if streaming is not None and self.aux_loss_enabled:
            raise ValueError("packd.trl: streaming needs no MoE load-balancing loss "
                             "(router_aux_loss_coef = 0): it is a statistic of TRL's micro-batch,"
                             " which a streamed micro-batch is not")
        self.packd_client = packd_client or packd.Client(packd_address)
        self.share_prompt, self.leak_probe = share_prompt, leak_probe
        self.tokens_forwarded = 0  # the packed streams' rows, over every forward
        # Why this trainer's micro-batches are TRL's own slices (none: whole groups).
        self.slice_reasons = self._slice_reasons()
        if micro_batches == "groups" and self.slice_reasons:
            raise ValueError("packd.trl: micro_batches='groups' would change the loss: "
                             + "; ".join(self.slice_reasons))
        if micro_batches == "trl":
            self.slice_reasons = self.slice_reasons or ["micro_batches='trl'"]
        self.micro_batches = micro_batches
        self.check_packed, self.check_every = check_packed, check_every
        self.check_tolerance = check_tolerance
        self.checked: Dict[str, float] = {}  # each model checked: its largest difference
        self._checked_at: Dict[Any, int] = {}
        self._served: Dict[int, str] = {}
        self._serve(self.model, "the policy")
        if self.ref_model is not None:
            self._serve(self.ref_model, "the reference model")
        # Per generation batch: each rank's tokens as placed here, and as TRL's own slices.
        self.rank_tokens: List[Any] = []
        self.streaming = streaming
        # The last streamed steps, each what it trained: examples (the generation batch's
        # prompts), groups (those taken, as they arrived), arrival (their indices in
        # examples), global_loss_tokens, micro_batches ((rows, tokens, summed loss) each).
        self.streamed_steps: Deque[Dict[str, Any]] = collections.deque(maxlen=16)
        self._rollouts: Optional[_stream.Rollouts] = None
        self._clients: Dict[str, packd.Client] = {}
        self._streamed = self._masked = self._gradient_scale = None

    def _serve(self, model: torch.nn.Module, name: str) -> None:
        """A model TRL scores through the log-prob hook, made to run packed: a family packd
        cannot train packed is refused here, by name; stateful layers run per document."""
        base = _base_model(self.accelerator.unwrap_model(model))
        check_model(base)
        bound_states(base)
        base.set_attn_implementation("packd_varlen")
        if self.leak_probe:  # a short packed row against each document alone
            probe_model(base, shared=self.share_prompt)
        self._served[id(base)] = name

    def _slice_reasons(self) -> List[str]:
        """The settings under which TRL's loss takes a statistic of its own micro-batch's tokens
        (or rows across optimizer steps), so that packd trains TRL's slices."""
        reasons = []
        if self.loss_type == "bnpo":
            reasons.append("loss_type='bnpo' divides by each micro-batch's token count")
        if self.top_entropy_quantile < 1.0:
            reasons.append("top_entropy_quantile < 1 masks by each micro-batch's quantile")
        if self._entropy_bonus_enabled:
            reasons.append("the entropy bonus is each micro-batch's token mean")
        if self.aux_loss_enabled:
            reasons.append("the MoE load-balancing loss is over each micro-batch's tokens")
        if self.args.steps_per_generation != self.args.gradient_accumulation_steps:
            reasons.append("steps_per_generation != gradient_accumulation_steps: each optimizer "
                           "step trains TRL's slices of the generation batch")
        return reasons

    def _prepare_inputs(self, generation_batch: Dict[str, Any]) -> Dict[str, Any]:
        """TRL's, with the generation batch split into packd's micro-batches instead of TRL's
        shuffled row slices (split_generation_batch)."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = self.split_generation_batch(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def split_generation_batch(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        """A scored generation batch (this process's rows) as this process's micro-batches.
        Whole groups: with several processes the whole batch is gathered first and its groups
        placed on the ranks (the same number of whole groups on each, evened out by tokens);
        then this rank's groups in steps_per_generation parts of the same number of whole
        groups each, evened out by tokens; every rank computes the same placement. TRL's slices
        (slice_reasons, or groups that do not divide so): TRL's own, from the same draw, each
        prompt's rows made consecutive."""
        for key in _MULTIMODAL:
            if batch.get(key) is not None:
                raise ValueError("packd.trl: %s: vision-language batches are not packed yet" % key)
        processes, parts = self.accelerator.num_processes, self.args.steps_per_generation
        local = len(batch["prompt_ids"])
        # TRL shuffles the rows with torch's generator: the same draw orders the micro-batches,
        # so that the random stream (and every later generation) stays TRL's. Every process
        # draws the same permutation of its own rows (one seed).
        draw = torch.randperm(local).tolist()
        rows = local * processes
        whole = (not self.slice_reasons and rows % self.num_generations == 0
                 and (rows // self.num_generations) % (processes * parts) == 0)
        if not whole:
            if not self.slice_reasons and self.micro_batches == "groups":
                raise ValueError(
                    "packd.trl: a generation batch of %d rows (num_generations = %d) does not "
                    "split into %d processes x steps_per_generation = %d micro-batches of whole "
                    "groups; micro_batches='auto' trains TRL's slices then"
                    % (rows, self.num_generations, processes, parts))
            size = local // parts  # TRL's split_tensor_dict
            return [_take(batch, _by_prompt(batch, draw[k * size:(k + 1) * size]))
                    for k in range(parts)]
        if processes > 1:
            batch = _gathered(self.accelerator, batch)
        tokens = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
        order = [p * local + i for p in range(processes) for i in draw]
        placed = whole_group_parts(tokens, self.num_generations, processes, order)
        mine = placed[self.accelerator.process_index]
        place = {row: i for i, row in enumerate(mine)}
        split = whole_group_parts([tokens[row] for row in mine], self.num_generations, parts,
                                  [place[row] for row in order if row in place])
        trl_slices = [sum(tokens[p * local:(p + 1) * local]) for p in range(processes)]
        self.rank_tokens.append(([sum(tokens[row] for row in rows) for rows in placed],
                                 trl_slices))
        return [_take(batch, [mine[i] for i in rows]) for rows in split]

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None, compute_entropy=False,
                                           compute_aux_loss=False, **multimodal):
        """The completion tokens' log-probs (and entropies, and a MoE model's load-balancing
        loss) in TRL's (B, logits_to_keep) shape, zero where the completion mask is: the rows
        packed by packd (prompts once per group with share_prompt; a streamed micro-batch comes
        packed), the model run over the packed stream, and TRL's fused LM head kernel applied to
        the rows that predict each completion token. The first time each model runs (and every
        check_every steps), checked against TRL's own padded path."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError("packd.trl: vision-language inputs are not packed yet")
        name = self._model_name(model)
        mask = attention_mask.bool()
        r = self._streamed if self._streamed is not None else self._packed(input_ids, mask,
                                                                            logits_to_keep)
        got = self._packed_logps(model, r, mask, logits_to_keep, compute_entropy,
                                 compute_aux_loss)
        if (self.check_packed and mask[:, mask.shape[1] - logits_to_keep:].any()
                and self._due(name)):
            self._check(name, model, r, input_ids, attention_mask, logits_to_keep, batch_size,
                        compute_entropy)
        return got

    def _model_name(self, model: torch.nn.Module) -> str:
        unwrapped = self.accelerator.unwrap_model(model)
        name = self._served.get(id(_base_model(unwrapped)))
        if name is None:
            raise ValueError("packd.trl: TRL scored a model packd.trl did not prepare (%s): "
                             "it would run packed rows through its own attention"
                             % type(unwrapped).__name__)
        if _adapters_disabled(unwrapped):
            name += " with its adapters disabled (the reference)"
        return name

    def _packed_logps(self, model, r, mask, logits_to_keep, compute_entropy, compute_aux_loss):
        """The model over a packed micro-batch `r` (its padded rows' mask `mask`): TRL's
        (log-probs, entropies or None, aux loss or None)."""
        completion = mask[:, mask.shape[1] - logits_to_keep:]
        self.tokens_forwarded += r.total_active
        device = mask.device
        base = _base_model(self.accelerator.unwrap_model(model))
        extra = {"output_router_logits": True} if compute_aux_loss else {}
        # Through the model as TRL calls it (a wrapper's forward included), its last hidden
        # state (after the final norm) taken and one position's logits computed.
        with self.accelerator.autocast():
            out = model(input_ids=r.packed[0][None].to(device),
                        position_ids=r.position_ids[None].to(device), use_cache=False,
                        output_hidden_states=True, logits_to_keep=1,
                        **shared_attention_kwargs(r), **extra)
        hidden = out.hidden_states[-1][0]
        head = base.get_output_embeddings()
        rows = hidden[r.shared.pred_index.to(device)]
        if self.args.cast_lm_head_to_fp32:
            rows = rows.float()
        softcap, scale = _head_scales(base)
        outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
        per_token = _kernels.ChunkedLogProbFunction.apply(
            rows.to(head.weight.device), head.weight, head.bias,
            r.shifted[0].to(head.weight.device), self.temperature, _CHUNK, softcap, scale,
            outputs)

        def placed(values):
            # Targets come row by row, each row's completion tokens in order (DESIGN §14); a
            # masked micro-batch's one placeholder target is dropped.
            values = values[:int(completion.sum())]
            return values.new_zeros(completion.shape).masked_scatter(completion, values)

        logps = placed(per_token[0])
        entropies = placed(per_token[1]) if compute_entropy else None
        aux_loss = None
        if compute_aux_loss:
            # TRL's fused head's loss (Mixtral's, on the padded rows under their attention
            # mask): each packed token weighted by how many padded rows hold it.
            text = base.config.get_text_config()
            weights = token_rows(r).to(device=device, dtype=torch.float32)
            if int(weights.sum()) != int(mask.sum()):
                raise ValueError("packd.trl: the packed stream holds %d of the micro-batch's %d "
                                 "tokens" % (int(weights.sum()), int(mask.sum())))
            aux_loss = load_balancing_loss_func(out.router_logits, text.num_experts,
                                                text.num_experts_per_tok, weights[None])
        return logps, entropies, aux_loss

    def _due(self, name: str) -> bool:
        step = self.state.global_step
        last = self._checked_at.get(name)
        if last is None:
            return True
        return bool(self.check_every) and step != last and step % self.check_every == 0

    def _check(self, name, model, r, input_ids, attention_mask, logits_to_keep, batch_size,
               compute_entropy) -> None:
        """The first-use check: the model's log-probs (and entropies) packed and through TRL's
        own padded path, both in eval mode (no dropout, no random draw) without gradients;
        PackedPathDiffers names the model and the largest difference beyond the tolerance."""
        self._checked_at[name] = self.state.global_step
        unwrapped = self.accelerator.unwrap_model(model)
        training, forwarded = unwrapped.training, self.tokens_forwarded
        unwrapped.eval()
        rows, row_mask = input_ids, attention_mask
        if self._streamed is not None:  # a streamed micro-batch's rows, as TRL pads them
            rows, row_mask = _padded_rows(self._streamed, logits_to_keep)
            rows, row_mask = rows.to(input_ids.device), row_mask.to(attention_mask.device)
        try:
            with torch.no_grad():
                packed = self._packed_logps(model, r, attention_mask.bool(), logits_to_keep,
                                            compute_entropy, False)
                padded = GRPOTrainer._get_per_token_logps_and_entropies(
                    self, model, rows, row_mask, logits_to_keep, batch_size, compute_entropy)
        finally:
            unwrapped.train(training)
            self.tokens_forwarded = forwarded
        dtype = next(unwrapped.parameters()).dtype
        tolerance = self.check_tolerance
        if tolerance is None or isinstance(tolerance, dict):
            tolerance = {**CHECK_TOLERANCE, **(tolerance or {})}.get(dtype, 0.25)
        completion = attention_mask.bool()[:, attention_mask.shape[1] - logits_to_keep:]
        worst = 0.0
        for what, got, want in zip(("log-prob", "entropy"), packed[:2], padded[:2]):
            if got is None or want is None:
                continue
            difference = (got.float() - want.float()).abs()[completion]
            if difference.numel() == 0:
                continue
            worst = max(worst, float(difference.max()))
            if float(difference.max()) > tolerance:
                row, col = divmod(int(((got.float() - want.float()).abs() * completion)
                                      .flatten().argmax()), completion.shape[1])
                raise PackedPathDiffers(
                    "packd.trl: %s's packed %ss differ from TRL's padded ones by up to %.3g "
                    "(row %d, completion token %d; tolerance %.3g for %s): packd will not "
                    "train it packed. Is each of its attention layers on packd_varlen and "
                    "its stateful layers per document? (check_packed=False skips this check)"
                    % (name, what, float(difference.max()), row, col, tolerance,
                       str(dtype).replace("torch.", "")))
        self.checked[name] = worst

    def _packed(self, input_ids: torch.Tensor, mask: torch.Tensor, logits_to_keep: int):
        """A micro-batch's padded rows packed by packd: with share_prompt, consecutive rows with
        one prompt are one group and its prompt is packed once."""
        B, S = input_ids.shape
        prompt = mask[:, :S - logits_to_keep]
        prompt_lengths = prompt.sum(1).tolist()
        if self.share_prompt:
            ids = input_ids[:, :prompt.shape[1]]
            groups, g = [], -1
            for b in range(B):
                if b == 0 or not torch.equal(ids[b][prompt[b]], ids[b - 1][prompt[b - 1]]):
                    g += 1
                groups.append(g)
        else:
            groups = list(range(B))
        return self.packd_client.pack(
            [input_ids.detach().cpu()], mask.cpu(), with_position_ids=True,
            layout=Layout(shared_prefix=SharedPrefix(groups, prompt_lengths, (0,)),
                          shifts=[(0, 0)]))

    # The streaming form (packd/integrations/trl_stream.py, docs/trl.md "Streaming").

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's; with streaming, one optimizer step's streaming step: rank 0 opens it and hands
        the generation batch's prompts to the rollout workers, every rank trains each
        micro-batch it receives (the summed token loss backpropagated; an empty one as a masked
        forward, so that the ranks' collectives stay in step)."""
        if self.streaming is None:
            return super().training_step(model, inputs, num_items_in_batch)
        started = time.perf_counter()
        model.train()
        loss = self._streamed_step(model, inputs)
        self._step += 1
        self._metrics["train"]["step_time"].append(time.perf_counter() - started)
        return loss

    def _streamed_step(self, model, inputs) -> torch.Tensor:
        from accelerate.utils import broadcast_object_list, gather_object
        processes, n = self.accelerator.num_processes, self.num_generations
        rows = gather_object(list(inputs)) if processes > 1 else list(inputs)
        if len(rows) % n or any(rows[i] != rows[i - i % n] for i in range(len(rows))):
            raise ValueError("packd.trl: the generation batch's rows are not num_generations = %d"
                             " copies of each prompt in a row (TRL's RepeatSampler)" % n)
        examples = rows[::n]
        version = self.state.global_step
        closer, shared = None, [None, None]
        if self.accelerator.is_main_process:
            if self._rollouts is None:
                self._rollouts = _stream.Rollouts(self.streaming)
            weights = None
            if self.streaming.weights_dir:
                weights = _stream.publish_weights(self.accelerator.unwrap_model(model),
                                                  self.streaming.weights_dir, version,
                                                  self.streaming.max_staleness)
            controller = self.packd_client.open_step(
                self.streaming.max_tokens, plan=packd.PlanOptions(num_ranks=processes),
                layout=_stream.stream_layout(), with_position_ids=True, policy_version=version,
                max_staleness=self.streaming.max_staleness, wave_fill=self.streaming.wave_fill)
            address = controller.address or self.packd_client.address
            shared = [controller.step_id, address]
            self._rollouts.run(address, controller.step_id, examples, n,
                               _stream.Policy(version, weights), self.scale_rewards)
            closer = _stream.StepCloser(self._rollouts, controller, len(examples))
            closer.start()
        if processes > 1:
            broadcast_object_list(shared)
        step_id, address = shared
        client = (self.packd_client if address == self.packd_client.address
                  else self._clients.setdefault(address, packd.Client(address)))
        total, batches = None, []
        stream = client.receive_step(step_id, self.accelerator.process_index)
        # DDP's all-reduce once per step, not per micro-batch: the ranks' summed gradients.
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        try:
            with model.no_sync() if ddp else contextlib.nullcontext():
                for mb in stream:
                    loss = self._streamed_loss(model, mb.result)
                    self.accelerator.backward(loss)
                    total = loss.detach() if total is None else total + loss.detach()
                    batches.append((len(mb.samples), int(mb.result.shifted[0].numel()),
                                    float(loss.detach())))
        except packd.PackdError:
            if closer is not None:
                if closer.failure is None:
                    closer.controller.cancel()  # another party's failure: end the step here too
                closer.join(timeout=30)
                if closer.failure:
                    raise RuntimeError("packd.trl: a rollout failed, and the step with it:\n"
                                       + closer.failure) from None
            raise
        report = [None]
        if closer is not None:
            closer.join()
            report = [_stream.StepReport.of(closer)]
        if processes > 1:
            broadcast_object_list(report)  # rank 0's, logged by every rank
        for key, value in report[0].metrics().items():
            self._metrics["train"][key].append(value)
        tokens = int(stream.global_loss_tokens)
        if ddp:
            _stream.sum_gradients(model.parameters())
        # Gradients averaged over the ranks (a wrapper's mean) or summed (DDP's, above).
        self._gradient_scale = (1 if ddp else processes, tokens)
        self.streamed_steps.append({"step_id": step_id, "examples": examples,
                                    "groups": report[0].groups, "arrival": report[0].arrival,
                                    "global_loss_tokens": tokens, "micro_batches": batches})
        if total is None:  # no micro-batch at all: every group refused
            total = torch.zeros((), device=self.args.device)
        # The mean over the ranks (the Trainer's log) is the step's token mean.
        return total * (processes / max(tokens, 1))

    def _streamed_loss(self, model, result) -> torch.Tensor:
        """TRL's _compute_loss of one received micro-batch: its summed token loss. An empty
        micro-batch is a masked forward of a one-token placeholder."""
        empty = result.shared is None or len(result.shared.target_cu_seqlens) <= 1
        if empty:
            result = self._placeholder()
        inputs = _stream.streamed_inputs(result, self.accelerator.num_processes)
        if empty:
            inputs["completion_mask"] = torch.zeros_like(inputs["completion_mask"])
        inputs = {k: v.to(self.args.device) for k, v in inputs.items()}
        self._streamed = result
        try:
            if self.beta != 0.0:
                inputs["ref_per_token_logps"] = self._reference_logps(inputs)
            return self._compute_loss(model, inputs)
        finally:
            self._streamed = None

    def _reference_logps(self, inputs: Dict[str, Any]) -> torch.Tensor:
        """A streamed micro-batch's reference log-probs, as TRL's generation computes them: the
        reference model's, or a PEFT policy's with its adapters disabled (its "ref" adapter
        where it has one), packed, without gradients."""
        from trl.trainer.utils import use_adapter
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        width = inputs["completion_ids"].shape[1]
        with torch.no_grad():
            if self.ref_model is not None:
                return self._get_per_token_logps_and_entropies(self.ref_model, input_ids, mask,
                                                               width)[0]
            unwrapped = self.accelerator.unwrap_model(self.model)
            with use_adapter(unwrapped,
                             adapter_name="ref" if "ref" in unwrapped.peft_config else None):
                return self._get_per_token_logps_and_entropies(self.model, input_ids, mask,
                                                               width)[0]

    def _placeholder(self):
        """A one-token stream with one target, packed once: the masked forward's."""
        if self._masked is None:
            self._masked = self.packd_client.pack(
                [torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2)],
                torch.ones(1, 2, dtype=torch.bool), with_position_ids=True,
                layout=Layout(shared_prefix=SharedPrefix([0], [1], (0,)),
                              shifts=[(0, 0), (1, 0)]))
        return self._masked

    def _scale_streamed(self) -> None:
        if self._gradient_scale is not None:
            packd.scale_gradients(self.model.parameters(), *self._gradient_scale)
            self._gradient_scale = None

    def _clip_grad_norm(self, model):
        """TRL's, after a streamed step's gradients were scaled by world_size / its global token
        count (transformers clips before on_pre_optimizer_step: a callback would be late)."""
        self._scale_streamed()
        return super()._clip_grad_norm(model)

    def _get_grad_norm(self, model, grad_norm=None):
        self._scale_streamed()  # max_grad_norm = 0: no clipping, the scale all the same
        return super()._get_grad_norm(model, grad_norm)

    def train(self, *args: Any, **kwargs: Any):
        try:
            return super().train(*args, **kwargs)
        finally:
            if self._rollouts is not None:
                self._rollouts.stop()
                self._rollouts = None
