"""packd.trl.PackedGRPOTrainer against TRL's own GRPOTrainer (the release pinned in
deploy/pypi-constraints.txt), on one frozen generation batch: a tiny Qwen 2 from its config, a
word-level tokenizer made in code, prompts of different lengths, truncated completions and
rewards computed in code. The loss and every parameter's gradient equal the stock trainer's in
float64 to 1e-12 for the loss types dapo, grpo and dr_grpo, with the prompt shared and not, and
with gradient accumulation 1 and 4; bnpo is refused by name.

TRL's fused LM-head kernel accumulates in float32 whatever its input, so the float64 proofs
replace it, in both trainers alike, with the same arithmetic in float64 (ExactLogProb); and the
float32 steps transformers takes in a float64 model (rotary angles, norms) stay in float64
(hf_families), since the padded rows' positions start at their left padding and the packed
rows' at 0."""
import random

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is on PyPI's stack only (deploy/pypi-constraints.txt)")
datasets = pytest.importorskip("datasets")

import trl.kernels  # noqa: E402
import trl.trainer.utils  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.trainer.utils import split_tensor_dict  # noqa: E402

import packd  # noqa: E402
from hf_families import Float64Steps, keep_float64  # noqa: E402
from packd.trl import PackedGRPOTrainer, whole_group_parts  # noqa: E402

# TRL's own configuration sets a field transformers 5.24 renamed.
pytestmark = pytest.mark.filterwarnings(
    r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning")

WORDS = ["<pad>", "<eos>", "<unk>"] + ["w%d" % i for i in range(45)]


def tokenizer():
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def prompts(n, seed=0):
    rng = random.Random(seed)
    return datasets.Dataset.from_dict({"prompt": [
        " ".join("w%d" % rng.randrange(45) for _ in range(rng.randint(2, 9))) for _ in range(n)]})


def tiny_qwen(dtype):
    config = Qwen2Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # EOS likely enough that some completions end before the limit
        model.lm_head.weight[1] *= 12
    return model.double() if dtype == torch.float64 else model  # its rotary buffers too


def reward(completions, **kwargs):
    """Rewards that differ within a group: so every group has advantages."""
    return [float(sum(int(w[1:]) for w in c.split() if w.startswith("w")) % 7)
            for c in completions]


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


def config(tmp_path, loss_type, accumulation):
    return GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, loss_type=loss_type, use_cpu=True, report_to=[],
        bf16=False, fp16=False, seed=0, beta=0.0, logging_steps=1)


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


def stock_and_packed(address, tmp_path, loss_type, share_prompt, accumulation, dtype):
    """The loss and gradients of one frozen generation batch through TRL's GRPOTrainer and
    through PackedGRPOTrainer, each from the same weights."""
    args = config(tmp_path, loss_type, accumulation)
    data, tok = prompts(64), tokenizer()
    stock = GRPOTrainer(model=tiny_qwen(dtype), reward_funcs=reward, args=args,
                        train_dataset=data, processing_class=tok)
    with packd.Client(address) as client:
        packed = PackedGRPOTrainer(model=tiny_qwen(dtype), reward_funcs=reward, args=args,
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


def assert_equal(got, want, tolerance):
    (got_loss, got_grads), (want_loss, want_grads) = got, want
    assert abs(got_loss - want_loss) <= tolerance * max(abs(want_loss), 1e-300), (
        got_loss, want_loss)
    assert set(got_grads) == set(want_grads)
    for name, g in want_grads.items():
        assert relative(got_grads[name], g) <= tolerance, (name, relative(got_grads[name], g))


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


def test_in_float32_with_trls_own_kernel(address, tmp_path):
    assert_equal(*stock_and_packed(address, tmp_path, "dapo", True, 4, torch.float32), 1e-6)


def test_five_optimizer_steps_log_what_the_stock_trainer_logs(address, monkeypatch, tmp_path):
    """trainer.train() for five optimizer steps (two micro-batches each, a new generation batch
    each step) from one seed: every logged loss, gradient norm and reward equal to 1e-9. The
    micro-batches hold other rows, so their losses differ and only their sum is equal: the
    Trainer sums them in a tensor of torch's default dtype, float64 here as the model is."""
    keep_float64(monkeypatch, ["qwen2"])
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    from transformers import set_seed
    histories = []
    with packd.Client(address) as client:
        for make in (GRPOTrainer, lambda **kw: PackedGRPOTrainer(packd_client=client, **kw)):
            args = config(tmp_path, "dapo", 2)
            args.max_steps, args.learning_rate = 5, 1e-2
            trainer = make(model=tiny_qwen(torch.float64), reward_funcs=reward, args=args,
                           train_dataset=prompts(64), processing_class=tokenizer())
            set_seed(0)
            torch.set_default_dtype(torch.float64)
            try:
                with Float64Steps().kept():
                    trainer.train()
            finally:
                torch.set_default_dtype(torch.float32)
            histories.append([h for h in trainer.state.log_history if "loss" in h])
    want, got = histories
    assert len(want) == len(got) == 5
    for step, (w, g) in enumerate(zip(want, got)):
        for key in ("loss", "grad_norm", "reward"):
            assert abs(g[key] - w[key]) <= 1e-9 * max(abs(w[key]), 1e-12), (step, key, g, w)


def test_bnpo_is_refused_by_name(address, tmp_path):
    with pytest.raises(ValueError, match="loss_type='bnpo' divides each micro-batch"):
        PackedGRPOTrainer(model=tiny_qwen(torch.float32), reward_funcs=reward,
                          args=config(tmp_path, "bnpo", 1), train_dataset=prompts(8),
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
