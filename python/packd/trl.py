"""TRL's GRPOTrainer on packd (docs/trl.md): the same loss and gradients, each group's prompt
forwarded once.

    from packd.trl import PackedGRPOTrainer        # instead of trl.GRPOTrainer
    trainer = PackedGRPOTrainer(model=model, reward_funcs=reward, args=GRPOConfig(...),
                                train_dataset=dataset, packd_client=packd.Client(address))
    trainer.train()

What changes, and nothing else:
- **Micro-batches of whole groups.** TRL shuffles a generation batch's rows and slices it into
  `steps_per_generation` micro-batches of equal row counts; here each micro-batch is whole
  groups (the same number of groups in each, so the same rows, placed to even out their
  tokens), so that a group's responses can share its prompt. The Trainer still runs exactly
  `gradient_accumulation_steps` forwards per optimizer step on every rank.
- **The forward through packd.** Each micro-batch's padded rows (prompts left-padded,
  completions right-padded) are packed by packd: with `share_prompt` (the default) each group's
  prompt once and its responses as its continuations (DESIGN §14), else one document per row.
  The model runs the packed stream with `attn_implementation="packd_varlen"` (registered here),
  and the per-token log-probs and entropies of the completion tokens come back in TRL's `(B, C)`
  shape, computed by TRL's own fused LM head kernel on the rows that predict them. TRL's
  `_compute_loss` then runs unchanged: importance sampling, clipping, entropy masks, the loss
  types and their normalisation, metrics and logging.
- **Loss types.** `dapo` (TRL's default), `cispo`, `vespo`, `grpo`, `dr_grpo`, `sapo` and `luspo`
  give TRL's values: the first three divide by the generation batch's token count, the others
  by per-micro-batch counts that equal row counts keep equal to TRL's. `bnpo` divides each
  micro-batch by its own token count, which whole-group micro-batches change: it is refused
  unless `accept_bnpo_difference=True`.

- **Several ranks.** With several processes (accelerate's DDP) each generation batch is gathered
  on every rank and its groups placed on the ranks, the same number of whole groups on each,
  evened out by tokens; each rank then splits its own groups as above. Every rank runs the
  same number of forwards, none of them empty.

Not yet: vision-language inputs and MoE auxiliary losses are refused by name."""
from typing import Any, Dict, List, Optional, Sequence

import torch

import packd
from packd.hf import register_varlen_attention, shared_attention_kwargs
from packd.layout import Layout, SharedPrefix

try:
    import trl.kernels as _kernels
    from trl import GRPOTrainer
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as _CHUNK
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("packd.trl needs TRL: pip install 'packd[trl]'") from e

__all__ = ["PackedGRPOTrainer"]

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


class PackedGRPOTrainer(GRPOTrainer):
    """trl.GRPOTrainer whose micro-batches are whole groups and whose forward runs packed
    through packd (the module's docstring). Takes every argument GRPOTrainer takes, and:
    packd_client (a packd.Client; default: one to packd_address, "127.0.0.1:50051" unless
    given), share_prompt (each group's prompt once; default True), accept_bnpo_difference
    (allow loss_type="bnpo", whose per-micro-batch normalisation whole-group micro-batches
    change)."""

    def __init__(self, *args: Any, packd_client: Optional[packd.Client] = None,
                 packd_address: str = "127.0.0.1:50051", share_prompt: bool = True,
                 accept_bnpo_difference: bool = False, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if getattr(config, "loss_type", None) == "bnpo" and not accept_bnpo_difference:
            raise ValueError(
                "packd.trl: loss_type='bnpo' divides each micro-batch's loss by that micro-batch's"
                " own token count, so micro-batches of whole groups give it another value than "
                "TRL's shuffled slices; use 'dapo' (the generation batch's token mean), or pass "
                "accept_bnpo_difference=True")
        register_varlen_attention()
        super().__init__(*args, **kwargs)
        model = self.accelerator.unwrap_model(self.model)
        model.set_attn_implementation("packd_varlen")
        self.packd_client = packd_client or packd.Client(packd_address)
        self.share_prompt = share_prompt
        self.tokens_forwarded = 0  # the packed streams' rows, over every forward
        # Per generation batch: each rank's tokens as placed here, and as TRL's own slices.
        self.rank_tokens: List[Any] = []
        self._softcap, self._logit_scale = _head_scales(model)

    def _prepare_inputs(self, generation_batch: Dict[str, Any]) -> Dict[str, Any]:
        """TRL's, with the generation batch split into micro-batches of whole groups instead of
        shuffled row slices."""
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            self._buffered_inputs = self.split_generation_batch(batch)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def split_generation_batch(self, batch: Dict[str, Any]) -> List[Dict[str, Any]]:
        """A scored generation batch (this process's rows) as this process's micro-batches: with
        several processes the whole batch is gathered first and its groups placed on the ranks
        (the same number of whole groups on each, evened out by tokens); then this rank's groups
        in steps_per_generation parts of the same number of whole groups each, evened out by
        tokens. Every rank computes the same placement from the same gathered batch."""
        for key in _MULTIMODAL:
            if batch.get(key) is not None:
                raise ValueError("packd.trl: %s: vision-language batches are not packed yet" % key)
        processes, parts = self.accelerator.num_processes, self.args.steps_per_generation
        local = len(batch["prompt_ids"])
        # TRL shuffles the rows with torch's generator: the same draw orders the groups, so
        # that the random stream (and every later generation) stays TRL's. Every process draws
        # the same permutation of its own rows (one seed).
        draw = torch.randperm(local).tolist()
        if processes > 1:
            batch = _gathered(self.accelerator, batch)
        tokens = (batch["prompt_mask"].sum(1) + batch["completion_mask"].sum(1)).tolist()
        order = [p * local + i for p in range(processes) for i in draw]
        groups = len(tokens) // self.num_generations
        if len(tokens) % self.num_generations == 0 and groups % (processes * parts):
            raise ValueError(
                "packd.trl: a generation batch of %d groups does not split into %d processes x "
                "steps_per_generation = %d micro-batches of whole groups: make the groups per "
                "generation batch (generation_batch_size / num_generations) a multiple of %d"
                % (groups, processes, parts, processes * parts))
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
        """The completion tokens' log-probs (and entropies) in TRL's (B, logits_to_keep) shape,
        zero where the completion mask is: the rows packed by packd (prompts once per group
        with share_prompt), the model run over the packed stream, and TRL's fused LM head
        kernel applied to the rows that predict each completion token."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError("packd.trl: vision-language inputs are not packed yet")
        if compute_aux_loss:
            raise ValueError("packd.trl: a MoE auxiliary loss is not computed packed yet")
        mask = attention_mask.bool()
        B, S = input_ids.shape
        prompt = mask[:, :S - logits_to_keep]
        prompt_lengths = prompt.sum(1).tolist()
        if self.share_prompt:  # consecutive rows with one prompt are one group
            ids = input_ids[:, :prompt.shape[1]]
            groups, g = [], -1
            for b in range(B):
                if b == 0 or not torch.equal(ids[b][prompt[b]], ids[b - 1][prompt[b - 1]]):
                    g += 1
                groups.append(g)
        else:
            groups = list(range(B))
        r = self.packd_client.pack(
            [input_ids.detach().cpu()], mask.cpu(), with_position_ids=True,
            layout=Layout(shared_prefix=SharedPrefix(groups, prompt_lengths, (0,)),
                          shifts=[(0, 0)]))
        self.tokens_forwarded += r.total_active
        device = input_ids.device
        # Through the model as TRL calls it (a wrapper's forward included), its last hidden
        # state (after the final norm) taken and one position's logits computed.
        with self.accelerator.autocast():
            hidden = model(
                input_ids=r.packed[0][None].to(device),
                position_ids=r.position_ids[None].to(device), use_cache=False,
                output_hidden_states=True, logits_to_keep=1,
                **shared_attention_kwargs(r)).hidden_states[-1][0]
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        rows = hidden[r.shared.pred_index.to(device)]
        if self.args.cast_lm_head_to_fp32:
            rows = rows.float()
        outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
        per_token = _kernels.ChunkedLogProbFunction.apply(
            rows.to(head.weight.device), head.weight, head.bias,
            r.shifted[0].to(head.weight.device), self.temperature, _CHUNK, self._softcap,
            self._logit_scale, outputs)
        completion = mask[:, S - logits_to_keep:]

        def placed(values):
            # Targets come row by row, each row's completion tokens in order (DESIGN §14).
            return values.new_zeros(completion.shape).masked_scatter(completion, values)

        logps = placed(per_token[0])
        entropies = placed(per_token[1]) if compute_entropy else None
        return logps, entropies, None
