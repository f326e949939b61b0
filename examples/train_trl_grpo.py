"""GRPO with TRL's trainer on packd: change one import (docs/trl.md).

A tiny Qwen 2 (built from its config, random weights) is trained by GRPO on prompts of a few
words: TRL generates 4 completions per prompt with transformers' generate on the CPU, scores
them with the reward below, and trains.
`packd.trl.PackedGRPOTrainer` is TRL's GRPOTrainer with every micro-batch packed by packd, each
group's prompt forwarded once; nothing else in the script changes.

    python examples/train_trl_grpo.py --address 127.0.0.1:50051            # train, print the log
    python examples/train_trl_grpo.py --address 127.0.0.1:50051 --check    # and compare
    accelerate launch --multi_gpu --num_processes 2 examples/train_trl_grpo.py --check  # 2 ranks
    python examples/train_trl_grpo.py --check --beta 0.04     # a KL penalty (a reference model)
    python examples/train_trl_grpo.py --check --uneven        # groups that straddle TRL's slices

    python examples/train_trl_grpo.py --address 127.0.0.1:50051 --streaming  # streaming form

--check trains TRL's own GRPOTrainer beside it from the same seed, in float64, and requires the
same loss, gradient norm and rewards at every step, to 1e-9 relative.

--streaming trains from packd's streaming step instead: two rollout worker processes generate
each group with transformers' generate from the weights of the policy version they are given
(the trainer saves each version's), score it and submit it as soon as it is scored, while
every rank trains the micro-batches packd sends it. With several processes
each rank trains its own micro-batches (DDP over gloo) and the check also prints how evenly
packd placed the tokens on the ranks, beside TRL's own slices.

Needs TRL: pip install 'packd[trl]'.
"""
import argparse
import contextlib
import os
import random
import sys
import tempfile
import warnings
import zlib

import torch

import packd

WORDS = ["<pad>", "<eos>", "<unk>"] + ["w%d" % i for i in range(45)]

# TRL 1.16's configuration still sets a field transformers 5.24 renamed.
warnings.filterwarnings("ignore", r"`\w*gradient_checkpointing\w*` is deprecated", FutureWarning)


def tokenizer():
    """A word-level tokenizer over WORDS, made in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def prompts(n, seed=0):
    """n prompts of 2 to 9 words."""
    from datasets import Dataset
    rng = random.Random(seed)
    return Dataset.from_dict({"prompt": [
        " ".join("w%d" % rng.randrange(45) for _ in range(rng.randint(2, 9))) for _ in range(n)]})


def tiny_qwen(dtype=torch.float32):
    """A 2-layer Qwen 2 (hidden 32), random weights; EOS made likely enough that some
    completions end before the length limit."""
    from transformers import Qwen2Config
    config = Qwen2Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
                         eos_token_id=1, bos_token_id=1)
    return tiny_model(config, dtype)


def tiny_model(config, dtype=torch.float32):
    """`config`'s causal LM, random weights from seed 0; EOS (id 1) made likely enough that some
    completions end before the length limit."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():
        model.lm_head.weight[1] *= 12
    return model.double() if dtype == torch.float64 else model  # its rotary buffers too


def reward(completions, **kwargs):
    """The sum of a completion's word numbers modulo 7: rewards that differ within a group."""
    return [float(sum(int(w[1:]) for w in c.split() if w.startswith("w")) % 7)
            for c in completions]


def config(output_dir, steps, loss_type="dapo", accumulation=2, **settings):
    """The run's GRPOConfig: 8 rows a micro-batch, groups of 4; `settings` override any field
    (beta for a KL penalty, num_generations, ...)."""
    from trl import GRPOConfig
    fields = dict(
        output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, loss_type=loss_type, use_cpu=True, report_to=[],
        bf16=False, fp16=False, seed=0, beta=0.0, logging_steps=1, max_steps=steps,
        learning_rate=1e-2)
    fields.update(settings)
    return GRPOConfig(**fields)


def train(client, steps, trainer_class=None, dtype=torch.float32, **settings):
    """Trains `steps` optimizer steps with PackedGRPOTrainer (or `trainer_class`, given TRL's
    own); returns the log of each step."""
    return [h for h in run(client, steps, trainer_class, dtype, **settings).state.log_history
            if "loss" in h]


def run(client, steps, trainer_class=None, dtype=torch.float32, micro_batches="auto",
        **settings):
    """The trainer, after `steps` optimizer steps (train's). With beta > 0 the model is saved
    first and given by its path, from which TRL loads its reference model."""
    from transformers import set_seed
    from packd.trl import PackedGRPOTrainer
    directory = tempfile.mkdtemp(prefix="train-trl-")
    model = tiny_qwen(dtype)
    if settings.get("beta"):
        model.save_pretrained(os.path.join(directory, "model"))
        model = os.path.join(directory, "model")
        settings["model_init_kwargs"] = {"dtype": dtype, "attn_implementation": "sdpa"}
    kwargs = dict(model=model, reward_funcs=reward, args=config(directory, steps, **settings),
                  train_dataset=prompts(64), processing_class=tokenizer())
    if trainer_class is None:
        trainer = PackedGRPOTrainer(packd_client=client, micro_batches=micro_batches, **kwargs)
    else:
        trainer = trainer_class(**kwargs)
    for m in (trainer.model, trainer.ref_model):
        if m is not None and dtype == torch.float64:
            m.double()  # a model loaded from its path: its rotary buffers too
    set_seed(0)
    trainer.train()
    return trainer


_POLICY = {}  # a rollout worker's model, by policy version


def rollout(example, n, policy):
    """The streaming form's rollout (a worker process's): n completions of the prompt sampled by
    transformers' generate from the policy version's weights, each up to and with its EOS,
    rewarded by reward()."""
    from packd.trl import ScoredGroup
    if policy.version not in _POLICY:
        model = tiny_qwen()
        model.load_state_dict(torch.load(policy.weights, weights_only=True))
        _POLICY.clear()
        _POLICY[policy.version] = model.eval()
    tok = tokenizer()
    prompt = tok(example["prompt"])["input_ids"]
    torch.manual_seed(zlib.crc32(("%d %s" % (policy.version, example["prompt"])).encode()))
    with torch.no_grad():
        out = _POLICY[policy.version].generate(
            torch.tensor([prompt] * n), attention_mask=torch.ones(n, len(prompt), dtype=torch.long),
            do_sample=True, max_new_tokens=6, eos_token_id=1, pad_token_id=0)
    completions = []
    for row in out[:, len(prompt):].tolist():
        completions.append(row[:row.index(1) + 1] if 1 in row else row)
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    return ScoredGroup(prompt, completions, reward(texts))


def train_streaming(client, steps, dtype=torch.float32, callbacks=None, **config):
    """Trains `steps` optimizer steps from streaming steps (rollout() in two worker processes);
    returns the trainer."""
    from packd.trl import PackedGRPOTrainer, Streaming
    from trl import GRPOConfig
    directory = tempfile.mkdtemp(prefix="train-trl-")
    args = GRPOConfig(
        output_dir=directory, per_device_train_batch_size=16, num_generations=4,
        max_completion_length=6, use_cpu=True, report_to=[], bf16=False, fp16=False, seed=0,
        beta=0.0, logging_steps=1, max_steps=steps, learning_rate=1e-2, **config)
    trainer = PackedGRPOTrainer(
        model=tiny_qwen(dtype), reward_funcs=reward, args=args, train_dataset=prompts(64),
        processing_class=tokenizer(), packd_client=client, callbacks=callbacks,
        streaming=Streaming(rollout, processes=2, max_tokens=48, max_staleness=0,
                            weights_dir=os.path.join(directory, "policy")))
    trainer.train()
    return trainer


@contextlib.contextmanager
def in_float64():
    """The checks' float64: TRL's LM-head kernel (which accumulates in float32) replaced by its
    arithmetic in float64, the float32 steps transformers takes in a float64 Qwen 2 (rotary
    angles, norms) kept in float64, float64 the default dtype (the Trainer's loss sum too); all
    undone on leaving."""
    import trl.kernels
    import trl.trainer.utils
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from float64_check import ExactLogProb, Float64Steps, keep_float64

    class Patch:
        def __init__(self):
            self.undo = []

        def setattr(self, target, name, value):
            self.undo.append((target, name, getattr(target, name)))
            setattr(target, name, value)

    patch = Patch()
    keep_float64(patch, ["qwen2"])
    patch.setattr(trl.kernels, "ChunkedLogProbFunction", ExactLogProb)
    patch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", ExactLogProb)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64Steps().kept():
            yield
    finally:
        torch.set_default_dtype(default)
        for target, name, value in reversed(patch.undo):
            setattr(target, name, value)


def token_mean(groups, dtype=torch.float64):
    """The token-mean loss of scored groups (TRL's dapo, the policy's own log-probs as the old
    ones: each token's loss -advantage * exp(logp - logp.detach())) and its gradients, without
    packd: each completion its own forward of tiny_qwen's initial weights. Returns the loss,
    each parameter's gradient and the token count."""
    from packd.integrations.trl_stream import group_advantages
    model = tiny_qwen(dtype)
    total, tokens = 0.0, 0
    for group in groups:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)  # as in the rollout worker's process
        try:
            advantages = group_advantages(group.rewards, "group")
        finally:
            torch.set_default_dtype(default)
        for completion, advantage in zip(group.completion_ids, advantages):
            ids = torch.tensor(list(group.prompt_ids) + list(completion))[None]
            logits = model(input_ids=ids).logits[0]
            p = len(group.prompt_ids)
            logp = torch.log_softmax(logits[p - 1:-1], -1).gather(
                1, torch.tensor(completion)[:, None])[:, 0]
            total = total + (-advantage * torch.exp(logp - logp.detach())).sum()
            tokens += len(completion)
    loss = total / tokens
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}, tokens


def check_streaming(client):
    """One streamed optimizer step in float64 (as check()'s), its gradients as the optimizer
    takes them (unclipped) against the token mean of the groups the step took, each row its own
    forward: the worst relative difference over the parameters."""
    from transformers import TrainerCallback

    class Gradients(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            self.grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    gradients = Gradients()
    with in_float64():
        trainer = train_streaming(client, 1, torch.float64, [gradients], max_grad_norm=0.0)
        step = trainer.streamed_steps[0]
        _, want, tokens = token_mean(step["groups"])
    assert tokens == step["global_loss_tokens"]
    return max(float((gradients.grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-300))
               for n, g in want.items())


def check(client, steps, keys=("loss", "grad_norm", "reward"), **settings):
    """The packed trainer beside TRL's own, in float64 (TRL's float32-accumulating LM-head
    kernel replaced in both by its arithmetic in float64, transformers' float32 steps kept in
    float64): the worst relative difference of the logged `keys` over the steps, whether both
    logged every step, and per generation batch the ranks' largest token count over their
    mean as packd placed them and as TRL's own slices hold them (whole-group micro-batches
    only). `settings`: GRPOConfig fields, and micro_batches."""
    from trl import GRPOTrainer
    trl_settings = {k: v for k, v in settings.items() if k != "micro_batches"}
    with in_float64():
        want = train(client, steps, GRPOTrainer, torch.float64, **trl_settings)
        packed = run(client, steps, dtype=torch.float64, **settings)
    got = [h for h in packed.state.log_history if "loss" in h]
    balance = [tuple(max(ranks) * len(ranks) / sum(ranks) for ranks in batch)
               for batch in packed.rank_tokens]
    worst = 0.0
    for w, g in zip(want, got):
        for key in keys:
            # Relative; absolute below 1e-6 (an on-policy loss whose advantages cancel is 0
            # up to rounding: -1.7e-17 against -1.9e-17).
            worst = max(worst, abs(g[key] - w[key]) / max(abs(w[key]), 1e-6))
    return worst, len(got) == len(want) == steps, balance


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--streaming", action="store_true")
    parser.add_argument("--beta", type=float, default=0.0, help="a KL penalty")
    parser.add_argument("--uneven", action="store_true",
                        help="6 rows a micro-batch in groups of 4: groups straddle TRL's slices")
    args = parser.parse_args()
    settings = {}
    if args.beta:
        settings.update(beta=args.beta)
    if args.uneven:
        settings.update(per_device_train_batch_size=6)
    with packd.Client(args.address) as client:
        if args.streaming and args.check:
            worst = check_streaming(client)
            print("streamed step against the whole batch's token mean: worst relative "
                  "difference %.1e" % worst)
            return 0 if worst <= 1e-12 else 1
        if args.streaming:
            trainer = train_streaming(client, args.steps)
            logs = [h for h in trainer.state.log_history if "loss" in h]
            for step, (log, streamed) in enumerate(zip(logs, trainer.streamed_steps)):
                print("rank %d, step %d: %d micro-batches, global tokens %d; loss %.6f, "
                      "grad_norm %.4f, reward %.3f, stale groups %d"
                      % (trainer.accelerator.process_index, step + 1,
                         len(streamed["micro_batches"]), streamed["global_loss_tokens"],
                         log["loss"], log["grad_norm"], log["reward"],
                         log["packd/stale_groups"]))
            return 0 if len(logs) == args.steps else 1
        if args.check:
            worst, complete, balance = check(client, args.steps, **settings)
            print("packd.trl against TRL's GRPOTrainer, %d steps: worst relative difference "
                  "%.1e" % (args.steps, worst))
            for i, (ours, trls) in enumerate(balance):
                print("generation batch %d: the busiest rank's tokens over the mean %.3f "
                      "(TRL's slices: %.3f)" % (i, ours, trls))
            return 0 if complete and worst <= 1e-9 else 1
        for step, log in enumerate(train(client, args.steps, **settings)):
            print("step %d: loss %.6f, grad_norm %.4f, reward %.3f"
                  % (step + 1, log["loss"], log["grad_norm"], log["reward"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
