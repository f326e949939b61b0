"""packd.trl.PackedGRPOTrainer against TRL's own GRPOTrainer (the release pinned in
deploy/pypi-constraints.txt), on one frozen generation batch: a tiny Qwen 2 from its config, a
word-level tokenizer made in code, prompts of different lengths, truncated completions and
rewards computed in code. The loss and every parameter's gradient equal the stock trainer's in
float64 to 1e-12 for the loss types dapo, grpo, dr_grpo and bnpo, with the prompt shared and not,
and with gradient accumulation 1 and 4. Beside them, the settings TRL's users turn on, each
against the stock trainer's own run on the same completions (replayed: the packed trainer
scores them, its reference model included): a KL penalty (beta = 0.04) on a plain and a hybrid
family, LoRA (with the KL penalty: its reference is the policy with its adapters disabled) on a
plain family and on Qwen 3.5, a Qwen 3 MoE with its router's load-balancing loss (float32),
top_entropy_quantile = 0.2, and a batch of 4 groups in 3 micro-batches; the first-use check
catching a reference model left on sdpa; the compatibility surface against the installed TRL.
(Five optimizer steps of train() beside TRL's: examples/test_train_trl_grpo.py.)

TRL's fused LM-head kernel accumulates in float32 whatever its input, so the float64 proofs
replace it, in both trainers alike, with the same arithmetic in float64 (ExactLogProb); and the
float32 steps transformers takes in a float64 model (rotary angles, norms) stay in float64
(hf_families), since the padded rows' positions start at their left padding and the packed
rows' at 0."""
import contextlib
import os
import sys

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is on PyPI's stack only (deploy/pypi-constraints.txt)")
datasets = pytest.importorskip("datasets")

import trl.kernels  # noqa: E402
import trl.trainer.utils  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

import packd  # noqa: E402
from hf_families import ExactLogProb, Float64Steps, keep_float64  # noqa: E402
from packd.integrations import compat as _trl_compat  # noqa: E402
from packd.trl import PackedGRPOTrainer, PackedPathDiffers, whole_group_parts  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from train_trl_grpo import (WORDS, config, prompts, reward, tiny_model, tiny_qwen,  # noqa: E402
                            tokenizer)

# TRL's own configuration sets a field transformers 5.24 renamed.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning")

def frozen_step(trainer, micro_batches, accumulation):
    """Every micro-batch's loss backpropagated, as the Trainer's accumulation runs them: the
    summed loss, and each parameter's gradient."""
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = accumulation
    total = 0.0
    with Float64Steps().kept():  # a float64 model's rotary angles and norms in float64 too
        for inputs in micro_batches:
            loss = trainer.compute_loss(trainer.model, inputs)
            loss.backward()
            total += loss.item()
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters()
                   if p.grad is not None}


def relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def tiny_qwen3_5(dtype):
    """A 2-layer Qwen 3.5 (a gated delta net, then attention; hidden 32), random weights, the
    example's vocabulary."""
    from transformers import Qwen3_5TextConfig
    return tiny_model(Qwen3_5TextConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=1), dtype)


def stock_and_packed(address, tmp_path, loss_type, share_prompt, accumulation, dtype,
                     tiny=tiny_qwen, **settings):
    """The loss and gradients of one frozen generation batch through TRL's GRPOTrainer and
    through PackedGRPOTrainer, each from the same weights."""
    args = config(str(tmp_path), -1, loss_type, accumulation)
    for key, value in settings.items():
        setattr(args, key, value)
    got, want, _ = run_both(address, args, lambda: tiny(dtype), share_prompt=share_prompt,
                            rows_per_part=8)
    return got, want


def run_both(address, args, model, share_prompt=True, rows_per_part=None, prompts_n=64,
             trainer_kwargs=None, packed_kwargs=None, one_group=False):
    """One generation batch: the stock trainer generates and scores it and trains its frozen
    step; the packed trainer is handed the same completions (TRL's _generate replayed) and
    scores them itself (rewards, advantages, its reference model's log-probs), then trains
    its own micro-batches. Returns ((loss, gradients) packed, (loss, gradients) stock, the
    packed trainer)."""
    data, tok = prompts(prompts_n), tokenizer()
    kwargs = dict(reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                  **(trainer_kwargs or {}))
    torch.manual_seed(1)  # the same adapters' draw, if any
    stock = GRPOTrainer(model=model(), **kwargs)
    with packd.Client(address) as client:
        torch.manual_seed(1)
        packed = PackedGRPOTrainer(model=model(), packd_client=client,
                                   share_prompt=share_prompt, **kwargs, **(packed_kwargs or {}))
        generated = []
        original = stock._generate
        stock._generate = lambda prompts: generated.append(original(prompts)) or generated[-1]
        packed._generate = lambda prompts: generated[0]
        if args.model_init_kwargs and args.model_init_kwargs.get("dtype") == torch.float64:
            for trainer in (stock, packed):  # loaded from a path: the rotary buffers too
                for m in (trainer.model, trainer.ref_model):
                    if m is not None:
                        m.double()
        stock.model.train()
        packed.model.train()
        inputs = next(iter(stock.get_train_dataloader()))
        with Float64Steps().kept():
            batch = stock._generate_and_score_completions(inputs)
            mine = packed._generate_and_score_completions(inputs)
        completion = batch["completion_mask"]
        assert 0 < int(completion.sum()) < completion.numel(), "some completions truncated"
        assert one_group or len(set(batch["prompt_mask"].sum(1).tolist())) > 1, (
            "prompts of several lengths")
        accumulation = args.gradient_accumulation_steps
        state = torch.get_rng_state()
        want = frozen_step(stock, split_tensor_dict(shuffled(batch), args.steps_per_generation),
                           accumulation)
        torch.set_rng_state(state)
        parts = packed.split_generation_batch(mine)
        assert len(parts) == args.steps_per_generation
        if rows_per_part is not None:
            assert {len(p["prompt_ids"]) for p in parts} == {rows_per_part}
        with packd_at_work(packed) as work:
            got = frozen_step(packed, parts, accumulation)
        # packd did the work: a Pack per micro-batch, packd_varlen reached, the packed streams
        # forwarded (fewer rows than the micro-batches' tokens where a prompt is shared).
        tokens = sum(int(p["prompt_mask"].sum() + p["completion_mask"].sum()) for p in parts)
        assert work["packs"] == len(parts) and work["attention"] > 0, work
        repeats = any(len(p["prompt_ids"]) > len({tuple(ids[m.bool()].tolist()) for ids, m in
                                                   zip(p["prompt_ids"], p["prompt_mask"])})
                      for p in parts)  # a micro-batch holding two rows of one prompt
        assert 0 < work["tokens"] <= tokens, (work, tokens)
        assert (work["tokens"] < tokens) == (share_prompt and repeats), (work, tokens)
    return got, want, packed


@contextlib.contextmanager
def packd_at_work(trainer):
    """Counts, while open, the trainer's Packs, the calls that reached packd_varlen and the
    packed rows forwarded."""
    from transformers import AttentionInterface
    from packd.integrations.varlen import NAME, varlen_attention
    work = {"packs": 0, "attention": 0, "tokens": trainer.tokens_forwarded}
    pack = trainer.packd_client.pack

    def counted_pack(*args, **kwargs):
        work["packs"] += 1
        return pack(*args, **kwargs)

    def counted_attention(*args, **kwargs):
        work["attention"] += 1
        return varlen_attention(*args, **kwargs)

    trainer.packd_client.pack = counted_pack
    AttentionInterface.register(NAME, counted_attention)
    try:
        yield work
    finally:
        AttentionInterface.register(NAME, varlen_attention)
        trainer.packd_client.pack = pack
        work["tokens"] = trainer.tokens_forwarded - work["tokens"]


def shuffled(batch):
    """TRL's shuffle of a generation batch (its _prepare_inputs'): the same draw packd makes."""
    from trl.trainer.utils import shuffle_sequence_dict
    return shuffle_sequence_dict(batch)


def assert_equal(got, want, tolerance, floor=0.0):
    """The losses and every gradient equal to `tolerance` relative (a gradient: to its largest
    value, or to `floor` times the model's largest gradient where that is larger)."""
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert abs(got_loss - want_loss) <= tolerance * max(abs(want_loss), 1e-300), (
        got_loss, want_loss)
    assert set(got_grads) == set(want_grads)
    largest = max(float(g.abs().max()) for g in want_grads.values())
    for name, g in want_grads.items():
        scale = max(float(g.abs().max()), floor * largest, 1e-300)
        error = float((got_grads[name] - g).abs().max()) / scale
        assert error <= tolerance, (name, error)


@pytest.mark.parametrize("accumulation", [1, 4])
@pytest.mark.parametrize("share_prompt", [True, False])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_loss_and_gradients_equal_the_stock_trainers(address, monkeypatch, tmp_path, loss_type,
                                                     share_prompt, accumulation):
    keep_float64(monkeypatch, ["qwen2"])
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    assert_equal(*stock_and_packed(address, tmp_path, loss_type, share_prompt, accumulation,
                                   torch.float64), 1e-12)


@pytest.mark.parametrize("share_prompt", [True, False])
def test_a_hybrid_family_trains_as_the_stock_trainer(address, monkeypatch, tmp_path,
                                                     share_prompt):
    """Qwen 3.5 (a gated delta net beside attention): its delta net runs each completion from
    the start of its prompt, the prompt once in the stream's attention
    (packd/integrations/stateful.py), and the loss and gradients equal TRL's on the padded batch, to 1e-9 as the survey's (the
    delta net's chunked scan over other batch shapes rounds differently; its gate bias's
    gradient, 1e-8 of the largest, is compared at that scale)."""
    keep_float64(monkeypatch, [])  # its norms: Float64Steps (frozen_step)
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    assert_equal(*stock_and_packed(address, tmp_path, "dapo", share_prompt, 2, torch.float64,
                                   tiny_qwen3_5), 1e-9, floor=1e-6)


def test_in_float32_with_trls_own_kernel(address, tmp_path):
    assert_equal(*stock_and_packed(address, tmp_path, "dapo", True, 4, torch.float32), 1e-6)


def test_micro_batches_are_whole_groups_of_even_tokens():
    tokens = [5, 5, 1, 1, 9, 9, 2, 2, 4, 4, 4, 4]  # six groups of two rows
    parts = whole_group_parts(tokens, 2, 3)
    assert sorted(r for p in parts for r in p) == list(range(12))
    for p in parts:
        assert len(p) == 4 and all(p[i] + 1 == p[i + 1] for i in range(0, 4, 2))
    loads = sorted(sum(tokens[r] for r in p) for p in parts)
    assert loads[-1] - loads[0] <= 10
    with pytest.raises(ValueError, match="does not split into steps_per_generation = 4"):
        whole_group_parts(tokens, 2, 4)


def exact_kernel(monkeypatch, families=("qwen2",)):
    """Float64 proofs: TRL's kernel's float32 accumulation replaced in both trainers by the same
    arithmetic in float64, and transformers' float32 steps kept in float64."""
    keep_float64(monkeypatch, list(families))
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)


def saved(tmp_path, model):
    """A tiny model saved where TRL's reference model is loaded from (TRL builds the reference
    from the policy's path)."""
    path = str(tmp_path / "model")
    model.save_pretrained(path)
    return path


def grpo_args(tmp_path, dtype, from_path=False, **settings):
    """The example's configuration (8 rows a micro-batch, 2 micro-batches), with `settings`; a
    model loaded from a path in `dtype`."""
    args = config(str(tmp_path), -1, "dapo", 2)
    if from_path:
        args.model_init_kwargs = {"dtype": dtype, "attn_implementation": "sdpa"}
    for key, value in settings.items():
        setattr(args, key, value)
    return args


def kl_logged(trainer):
    return trainer._metrics["train"]["kl"]


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_a_kl_penalty_runs_the_reference_model_packed(address, monkeypatch, tmp_path, family):
    """beta = 0.04: TRL builds a reference model from the policy's path; packd runs it packed
    too (its log-probs in the generation batch are the packed trainer's own), so the logged KL
    of the first step is 0, as stock's, and the loss and gradients equal stock's."""
    exact_kernel(monkeypatch, ["qwen2"] if family == "qwen2" else [])
    tiny = tiny_qwen if family == "qwen2" else tiny_qwen3_5
    path = saved(tmp_path, tiny(torch.float64))
    got, want, packed = run_both(address, grpo_args(tmp_path, torch.float64, True, beta=0.04),
                                 lambda: path)
    assert packed.ref_model is not None
    assert packed.checked["the reference model"] <= 1e-8  # checked, and within its tolerance
    assert max(abs(k) for k in kl_logged(packed)) == 0.0
    assert_equal(got, want, 1e-10 if family == "qwen2" else 1e-9,
                 floor=0.0 if family == "qwen2" else 1e-6)


@pytest.mark.parametrize("family", ["qwen2", "qwen3_5"])
def test_lora_with_a_kl_penalty(address, monkeypatch, tmp_path, family):
    """TRL's peft_config: a LoRA adapter (random A and B, so that the policy differs from its
    reference), beta = 0.04: the reference is the policy with its adapters disabled, run
    packed; the adapters' gradients equal stock's."""
    peft = pytest.importorskip("peft")
    exact_kernel(monkeypatch, ["qwen2"] if family == "qwen2" else [])
    tiny = tiny_qwen if family == "qwen2" else tiny_qwen3_5
    lora = peft.LoraConfig(r=4, lora_alpha=1, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "up_proj"])
    got, want, packed = run_both(address, grpo_args(tmp_path, torch.float64, beta=0.04),
                                 lambda: tiny(torch.float64),
                                 trainer_kwargs={"peft_config": lora})
    assert set(got[1]) and all("lora_" in name for name in got[1])
    assert packed.checked["the policy with its adapters disabled (the reference)"] <= 1e-8
    assert min(kl_logged(packed)) > 0  # the adapters move the policy off its reference
    assert_equal(got, want, 1e-10 if family == "qwen2" else 1e-9,
                 floor=0.0 if family == "qwen2" else 1e-6)


def test_top_entropy_quantile_trains_trls_slices(address, monkeypatch, tmp_path):
    """top_entropy_quantile = 0.2: TRL's threshold is each micro-batch's quantile, so packd
    trains TRL's own slices (each prompt's rows in a slice sharing it)."""
    exact_kernel(monkeypatch)
    args = grpo_args(tmp_path, torch.float64, top_entropy_quantile=0.2)
    got, want, packed = run_both(address, args, lambda: tiny_qwen(torch.float64),
                                 rows_per_part=8)
    assert any("top_entropy_quantile" in r for r in packed.slice_reasons)
    assert packed.tokens_forwarded > 0  # ran packed
    assert_equal(got, want, 1e-10)


def test_groups_that_do_not_divide_into_micro_batches(address, monkeypatch, tmp_path):
    """per_device_train_batch_size = 8, num_generations = 6, gradient_accumulation_steps = 3: a
    generation batch of 4 groups for 3 micro-batches, which TRL trains with groups straddling
    its slices: packd trains those slices, each prompt shared within one."""
    exact_kernel(monkeypatch)
    from trl import GRPOConfig
    for loss_type in ("dapo", "grpo"):
        args = GRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=6,
            max_completion_length=6, gradient_accumulation_steps=3, loss_type=loss_type,
            use_cpu=True, report_to=[], bf16=False, fp16=False, seed=0, beta=0.0,
            max_steps=-1, learning_rate=1e-2)
        got, want, packed = run_both(address, args, lambda: tiny_qwen(torch.float64),
                                     rows_per_part=8)
        assert packed.slice_reasons == []  # whole groups where they divide; not here
        assert_equal(got, want, 1e-10)


def tiny_qwen3_moe(dtype):
    """A 2-layer Qwen 3 MoE (4 experts, 2 per token; the router's default auxiliary loss
    coefficient, 0.001, made 0.5 so that the loss weighs), random weights."""
    from transformers import Qwen3MoeConfig
    return tiny_model(Qwen3MoeConfig(
        vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5, decoder_sparse_step=1,
        max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, bos_token_id=1), dtype)


def test_a_moe_model_with_its_load_balancing_loss(address, tmp_path):
    """TRL turns the router's load-balancing loss on for a MoE model; packd computes it on the
    packed stream (each token weighted by the rows that hold it) over TRL's own slices: the
    loss and gradients equal stock's, in float32 with TRL's kernel (the CPU's grouped experts
    take no float64)."""
    args = grpo_args(tmp_path, torch.float32)
    got, want, packed = run_both(address, args, lambda: tiny_qwen3_moe(torch.float32),
                                 rows_per_part=8)
    assert packed.aux_loss_enabled
    assert packed._metrics["train"]["aux_loss"]
    assert_equal(got, want, 1e-5, floor=1e-3)


def test_the_first_use_check_catches_a_reference_left_on_sdpa(address, monkeypatch, tmp_path):
    exact_kernel(monkeypatch)
    path = saved(tmp_path, tiny_qwen(torch.float64))
    args = grpo_args(tmp_path, torch.float64, True, beta=0.04)
    with packd.Client(address) as client:
        packed = PackedGRPOTrainer(model=path, reward_funcs=reward, args=args,
                                   train_dataset=prompts(64), processing_class=tokenizer(),
                                   packd_client=client)
        packed.ref_model.set_attn_implementation("sdpa")  # the packed path broken on purpose
        packed.model.train()
        with pytest.raises(PackedPathDiffers, match="the reference model's packed log-probs"):
            packed._generate_and_score_completions(next(iter(packed.get_train_dataloader())))


def test_liger_is_refused_by_name(address, tmp_path):
    args = grpo_args(tmp_path, torch.float32)
    args.use_liger_kernel = True
    with pytest.raises(ValueError, match="use_liger_kernel"):
        PackedGRPOTrainer(model=tiny_qwen(torch.float32), reward_funcs=reward, args=args,
                          train_dataset=prompts(8), processing_class=tokenizer(),
                          packd_address=address)


def test_the_compatibility_surface_matches_the_installed_trl(monkeypatch):
    """Every private name packd.trl relies on is where the tested release has it; a renamed
    one, a changed signature or an untested release is named."""
    assert _trl_compat.problems() == [], "re-check packd/integrations/compat.py against this TRL"
    import trl.trainer.grpo_trainer as grpo
    monkeypatch.setattr(grpo.GRPOTrainer, "get_high_entropy_mask",
                        lambda self, entropies, threshold: None)
    monkeypatch.delattr(trl.trainer.utils, "split_tensor_dict")
    monkeypatch.setattr(trl, "__version__", "1.99.0")
    import transformers
    import transformers.masking_utils
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    monkeypatch.setattr(transformers.masking_utils, "sdpa_mask",
                        lambda batch_size, q_length, kv_length, mask_function=None: None)
    found = " | ".join(_trl_compat.problems())
    assert "GRPOTrainer.get_high_entropy_mask takes" in found
    assert "trl.trainer.utils.split_tensor_dict is missing" in found
    assert "TRL 1.99.0 is outside" in found
    assert "transformers 5.99.0 is outside" in found
    assert "transformers.masking_utils.sdpa_mask takes" in found
    with pytest.raises(RuntimeError, match="packd.trl cannot vouch for this TRL"):
        _trl_compat.check()
    # packd.hf's users, without TRL: a moved name refuses, an untested release warns.
    with pytest.raises(RuntimeError, match="packd cannot vouch for this transformers: "
                       "transformers.masking_utils.sdpa_mask takes"):
        with pytest.warns(RuntimeWarning, match="transformers 5.99.0 is outside"):
            _trl_compat.check_transformers()


@pytest.mark.parametrize("share_prompt", [True, False])
def test_a_micro_batch_of_one_sequence_on_a_hybrid_family(address, monkeypatch, tmp_path,
                                                           share_prompt):
    """per_device_train_batch_size = 1 (each micro-batch one rollout, as a token budget often
    leaves a long one alone), Qwen 3.5: its gated delta net runs the one sequence from a zero
    state, and the loss and gradients equal stock's (to 1e-9 as the hybrid's above)."""
    exact_kernel(monkeypatch, [])
    from trl import GRPOConfig
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=1, num_generations=4,
        max_completion_length=6, gradient_accumulation_steps=4, use_cpu=True, report_to=[],
        bf16=False, fp16=False, seed=0, beta=0.0, max_steps=-1, learning_rate=1e-2)
    got, want, packed = run_both(address, args, lambda: tiny_qwen3_5(torch.float64),
                                 share_prompt=share_prompt, rows_per_part=1, one_group=True)
    assert packed.slice_reasons == []  # one group for four micro-batches: TRL's slices
    assert_equal(got, want, 1e-9, floor=1e-6)
