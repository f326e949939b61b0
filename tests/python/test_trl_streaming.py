"""packd.trl's streaming form: PackedGRPOTrainer(streaming=Streaming(rollout, ...)) trains from a
streaming step whose groups rollout workers (their own processes) submit as they are scored.
The gradients of an optimizer step equal the whole batch's token mean, computed without packd
(each row its own forward: train_trl_grpo.token_mean), to 1e-12 in float64 in three arrival
orders; the mean of
each micro-batch's own token mean is another number on the same batch. Stale groups are
refused and counted in TRL's metrics, a failed rollout ends the step with its error, and the
settings streaming cannot honour are refused by name. Needs TRL (PyPI's stack)."""
import functools
import os
import sys

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is on PyPI's stack only (deploy/pypi-constraints.txt)")

import trl.kernels  # noqa: E402
import trl.trainer.utils  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import packd  # noqa: E402
from hf_families import ExactLogProb, Float64Steps, keep_float64  # noqa: E402
from packd.trl import PackedGRPOTrainer, Policy, Streaming  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "examples"))
from train_trl_grpo import prompts, reward, tiny_qwen, token_mean, tokenizer  # noqa: E402
from trl_rollouts import scripted  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    r"ignore:`\w*gradient_checkpointing\w*` is deprecated:FutureWarning")

GROUPS, N = 8, 4


def streaming_config(output_dir, steps=1, **overrides):
    from trl import GRPOConfig
    kwargs = dict(output_dir=output_dir, per_device_train_batch_size=GROUPS * N,
                  num_generations=N, max_completion_length=6, gradient_accumulation_steps=1,
                  steps_per_generation=1, use_cpu=True, report_to=[], bf16=False, fp16=False,
                  seed=0, beta=0.0, logging_steps=1, max_steps=steps, learning_rate=1e-2,
                  max_grad_norm=1e9)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


class Gradients(TrainerCallback):
    """Every parameter's gradient as the optimizer is about to take it, per step."""

    def __init__(self, model):
        self.model, self.steps = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in self.model.named_parameters()
                           if p.grad is not None})


@pytest.fixture
def float64(monkeypatch):
    keep_float64(monkeypatch, ["qwen2"])
    monkeypatch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    torch.set_default_dtype(torch.float64)  # the Trainer's loss sum too
    try:
        with Float64Steps().kept():
            yield
    finally:
        torch.set_default_dtype(torch.float32)


def streamed(address, tmp_path, rollout, dtype=torch.float64, steps=1, max_tokens=40,
             trainer_kwargs=None, callbacks=(), **config):
    model = tiny_qwen(dtype)
    gradients = Gradients(model)
    with packd.Client(address) as client:
        trainer = PackedGRPOTrainer(
            model=model, reward_funcs=reward, args=streaming_config(str(tmp_path), steps, **config),
            train_dataset=prompts(64), processing_class=tokenizer(), packd_client=client,
            callbacks=[gradients, *callbacks], **(trainer_kwargs or {}),
            streaming=Streaming(rollout, processes=2, max_tokens=max_tokens,
                                weights_dir=str(tmp_path / "policy")))
        trainer.train()
    return trainer, gradients.steps


def relative(got, want):
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


def test_gradients_are_the_whole_batch_token_mean_in_any_arrival_order(address, tmp_path,
                                                                       float64):
    arrivals = []
    for order_seed in range(3):
        rollout = functools.partial(scripted, order_seed=order_seed, delay=0.2)
        trainer, gradients = streamed(address, tmp_path / str(order_seed), rollout)
        step = trainer.streamed_steps[0]
        assert len(step["examples"]) == GROUPS and len(step["micro_batches"]) >= 3
        arrivals.append(tuple(step["arrival"]))
        # The groups as the workers made them: the same whatever process or order.
        assert [g.completion_ids for g in step["groups"]] == [
            rollout(step["examples"][i], N, Policy(0)).completion_ids for i in step["arrival"]]
        want_loss, want, tokens = token_mean(step["groups"])
        assert step["global_loss_tokens"] == tokens
        logged = [h for h in trainer.state.log_history if "loss" in h][0]
        assert abs(logged["loss"] - want_loss) <= 1e-12 * abs(want_loss)
        assert logged["packd/stale_groups"] == 0 and logged["packd/groups"] == GROUPS
        for name, g in want.items():
            assert relative(gradients[0][name], g) <= 1e-12, (order_seed, name)
        # The quiet bug on the same micro-batches: each one's own token mean, averaged.
        batches = step["micro_batches"]
        per_micro_batch = sum(loss / t for _, t, loss in batches) / len(batches)
        assert abs(per_micro_batch - want_loss) > 1e-3 * abs(want_loss), (per_micro_batch,
                                                                          want_loss)
    assert len(set(arrivals)) > 1, arrivals


def test_stale_groups_are_refused_and_counted(address, tmp_path):
    examples = prompts(64)["prompt"]
    rollout = functools.partial(scripted, stale=set(examples[::3]))
    trainer, _ = streamed(address, tmp_path, rollout, dtype=torch.float32, steps=2)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    for log, step in zip(logs, trainer.streamed_steps):
        stale = sum(e["prompt"] in rollout.keywords["stale"] for e in step["examples"])
        assert stale > 0 and log["packd/stale_groups"] == stale
        assert log["packd/groups"] == GROUPS - stale
        assert all(step["examples"][i]["prompt"] not in rollout.keywords["stale"]
                   for i in step["arrival"])
        assert step["global_loss_tokens"] == sum(
            len(c) for g in step["groups"] for c in g.completion_ids)


def test_a_failed_rollout_ends_the_step_with_its_error(address, tmp_path):
    rollout = functools.partial(scripted, fail=set(prompts(64)["prompt"]))
    with pytest.raises(RuntimeError, match="a rollout failed(.|\n)*the rollout of .* failed"):
        streamed(address, tmp_path, rollout, dtype=torch.float32)


@pytest.mark.parametrize("overrides, words", [
    ({"gradient_accumulation_steps": 2}, "gradient_accumulation_steps = steps_per_generation"),
    ({"loss_type": "grpo"}, "loss_type one of dapo, cispo, vespo"),
    ({"top_entropy_quantile": 0.2}, "no entropy bonus or mask"),
    ({"scale_rewards": "batch"}, "scale_rewards 'group' or 'none'"),
])
def test_what_streaming_cannot_honour_is_refused_by_name(address, tmp_path, overrides, words):
    with pytest.raises(ValueError, match="streaming needs .*" + words):
        PackedGRPOTrainer(model=tiny_qwen(), reward_funcs=reward,
                          args=streaming_config(str(tmp_path), **overrides),
                          train_dataset=prompts(64), processing_class=tokenizer(),
                          packd_address=address, streaming=Streaming(scripted))


class Initial(TrainerCallback):
    """The model's weights as training begins (a copy)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_kl_penalty_with_lora_streams(address, tmp_path, float64):
    """beta = 0.04 and a LoRA adapter (random A and B): each received micro-batch's reference
    log-probs are the policy's with its adapters disabled, packed; the step's gradients equal
    the whole batch's token mean of TRL's per-token loss, each row its own forward (the
    adapters on, and off for the reference), and the weights published for the rollouts are
    the adapters merged into the base model's."""
    peft = pytest.importorskip("peft")
    from packd.integrations.trl_stream import group_advantages
    lora = peft.LoraConfig(r=4, lora_alpha=1, lora_dropout=0.0, init_lora_weights=False,
                           target_modules=["q_proj", "v_proj", "up_proj"])
    initial, beta = Initial(), 0.04
    trainer, gradients = streamed(address, tmp_path, scripted, beta=beta,
                                  trainer_kwargs={"peft_config": lora}, callbacks=[initial])
    step = trainer.streamed_steps[0]
    model = peft.get_peft_model(tiny_qwen(torch.float64), lora)  # the weights trained from
    model.load_state_dict(initial.state)
    total, tokens = 0.0, 0
    for group in step["groups"]:
        torch.set_default_dtype(torch.float32)  # as in the rollout worker's process
        advantages = group_advantages(group.rewards, "group")
        torch.set_default_dtype(torch.float64)
        for completion, advantage in zip(group.completion_ids, advantages):
            ids = torch.tensor(list(group.prompt_ids) + list(completion))[None]
            p, target = len(group.prompt_ids), torch.tensor(completion)[:, None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0][p - 1:-1], -1).gather(
                1, target)[:, 0]
            with torch.no_grad(), model.disable_adapter():
                ref = torch.log_softmax(model(input_ids=ids).logits[0][p - 1:-1], -1).gather(
                    1, target)[:, 0]
            ratio = torch.exp(logp - logp.detach())  # the old log-probs are the policy's own
            kl = (torch.exp(ref - logp) - (ref - logp) - 1) * ratio  # use_bias_correction_kl
            total = total + (-advantage * ratio + beta * kl).sum()
            tokens += len(completion)
    (total / tokens).backward()
    assert tokens == step["global_loss_tokens"]
    want = {n: q.grad for n, q in model.get_base_model().named_parameters() if q.requires_grad}
    assert want and all("lora_" in n for n in want)
    for name, g in want.items():
        assert relative(gradients[0][name], g) <= 1e-12, name
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    assert logged["kl"] > 0
    # The published weights: the base model's names, each adapted weight W + its delta.
    weights = torch.load(str(tmp_path / "policy" / "policy-0.pt"), weights_only=True)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    assert set(weights) == set(tiny_qwen(torch.float64).state_dict())
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"],
                       layer.get_base_layer().weight + layer.get_delta_weight("default"))
