"""packd.trl.PackedGRPOTrainer against TRL's own GRPOTrainer (the release pinned in
deploy/pypi-constraints.txt), on one frozen generation batch: a tiny Qwen 2 from its config, a
word-level tokenizer made in code, prompts of different lengths, truncated completions and
rewards computed in code. The loss and every parameter's gradient equal the stock trainer's in
float64 to 1e-12 for the loss types dapo, grpo and dr_grpo, with the prompt shared and not, and
with gradient accumulation 1 and 4; bnpo is refused by name. (Five optimizer steps of train()
beside TRL's: examples/test_train_trl_grpo.py.)

TRL's fused LM-head kernel accumulates in float32 whatever its input, so the float64 proofs
replace it, in both trainers alike, with the same arithmetic in float64 (ExactLogProb); and the
float32 steps transformers takes in a float64 model (rotary angles, norms) stay in float64
(hf_families), since the padded rows' positions start at their left padding and the packed
rows' at 0."""
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
from exact_log_prob import ExactLogProb  # noqa: E402
from hf_families import Float64Steps, keep_float64  # noqa: E402
from packd.trl import PackedGRPOTrainer, whole_group_parts  # noqa: E402

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
                     tiny=tiny_qwen):
    """The loss and gradients of one frozen generation batch through TRL's GRPOTrainer and
    through PackedGRPOTrainer, each from the same weights."""
    args = config(str(tmp_path), -1, loss_type, accumulation)
    data, tok = prompts(64), tokenizer()
    stock = GRPOTrainer(model=tiny(dtype), reward_funcs=reward, args=args,
                        train_dataset=data, processing_class=tok)
    with packd.Client(address) as client:
        packed = PackedGRPOTrainer(model=tiny(dtype), reward_funcs=reward, args=args,
                                   train_dataset=data, processing_class=tok,
                                   packd_client=client, share_prompt=share_prompt)
        stock.model.train()
        batch = stock._generate_and_score_completions(next(iter(stock.get_train_dataloader())))
        completion = batch["completion_mask"]
        assert 0 < int(completion.sum()) < completion.numel(), "some completions truncated"
        assert len(set(batch["prompt_mask"].sum(1).tolist())) > 1, "prompts of several lengths"
        want = frozen_step(stock, split_tensor_dict(batch, accumulation), accumulation)
        parts = packed.split_generation_batch(batch)
        assert len(parts) == accumulation
        assert {len(p["prompt_ids"]) for p in parts} == {8}
        got = frozen_step(packed, parts, accumulation)
    return got, want


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
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
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
    the start of its prompt, the prompt once in the stream's attention (packd/_stateful.py),
    and the loss and gradients equal TRL's on the padded batch, to 1e-9 as the survey's (the
    delta net's chunked scan over other batch shapes rounds differently; its gate bias's
    gradient, 1e-8 of the largest, is compared at that scale)."""
    keep_float64(monkeypatch, [])  # its norms: Float64Steps (frozen_step)
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    assert_equal(*stock_and_packed(address, tmp_path, "dapo", share_prompt, 2, torch.float64,
                                   tiny_qwen3_5), 1e-9, floor=1e-6)


def test_in_float32_with_trls_own_kernel(address, tmp_path):
    assert_equal(*stock_and_packed(address, tmp_path, "dapo", True, 4, torch.float32), 1e-6)


def test_bnpo_is_refused_by_name(address, tmp_path):
    with pytest.raises(ValueError, match="loss_type='bnpo' divides each micro-batch"):
        PackedGRPOTrainer(model=tiny_qwen(torch.float32), reward_funcs=reward,
                          args=config(str(tmp_path), -1, "bnpo", 1), train_dataset=prompts(8),
                          processing_class=tokenizer(), packd_address=address)


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
