"""TRL's GRPOTrainer against packd.trl.PackedGRPOTrainer on the same frozen generation batches
(docs/performance.md, "TRL's GRPOTrainer on packd"), four ways timed in one run:

  stock         trl.GRPOTrainer: every row padded to the generation batch's prompt and
                completion lengths, each prompt forwarded once per response;
  packd         PackedGRPOTrainer(share_prompt=False): whole-group micro-batches, each row one
                packed document;
  packd shared  PackedGRPOTrainer: each group's prompt once;
  packd slices  PackedGRPOTrainer(micro_batches="trl"): TRL's own slices, each prompt once per
                slice that holds its rows (what bnpo, an entropy mask or a MoE's
                load-balancing loss train).

The model is bench-train's Qwen 3 from its config (float32, random weights); a generation batch
is --groups groups of --members responses to prompts of --prompt tokens, responses lognormal
within --responses, with random advantages (generation is not timed: the batches are frozen,
the same for every way). An optimizer step is TRL's: gradient_accumulation_steps micro-batches
through the trainer's compute_loss and backward, then AdamW. Printed: the tokens each way
forwards per optimizer step, and the time of a step (the median after a warm-up).

    bench_trl.py --packd build/bin/packd          # the table in docs/performance.md
    bench_trl.py --smoke --packd build/bin/packd  # tiny: every way's loss equal, to 1e-5
"""
import argparse
import math
import os
import random
import statistics
import sys
import tempfile
import time
import warnings

import torch

# TRL 1.16's configuration still sets a field transformers 5.24 renamed.
warnings.filterwarnings("ignore", r"`\w*gradient_checkpointing\w*` is deprecated", FutureWarning)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import add_server_arguments, server  # noqa: E402
from bench_train import model_of  # noqa: E402

import packd  # noqa: E402
from packd.hf import register_varlen_attention  # noqa: E402


def generation_batch(seed, vocab, groups, members, prompt, responses):
    """A scored generation batch as TRL's _generate_and_score_completions returns it: prompts
    left-padded, completions right-padded, one advantage per row, the token count."""
    rng = random.Random(seed)
    lo, hi = responses
    rows = []
    for _ in range(groups):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))]
        for _ in range(members):
            n = int(min(hi, max(lo, math.exp(rng.gauss(math.log(lo * hi) / 2,
                                                        math.log(hi / lo) / 4)))))
            rows.append((p, [rng.randrange(3, vocab) for _ in range(n)]))
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    B = len(rows)
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.zeros(B, C, dtype=torch.long)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for b, (p, c) in enumerate(rows):
        prompt_ids[b, P - len(p):], prompt_mask[b, P - len(p):] = torch.tensor(p), 1
        completion_ids[b, :len(c)], completion_mask[b, :len(c)] = torch.tensor(c), 1
    g = torch.Generator().manual_seed(seed)
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": torch.randn(B, generator=g),
            "num_items_in_batch": completion_mask.sum()}


def trainer_of(kind, model, address, batch_rows, members, accumulation, max_completion):
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import GRPOConfig, GRPOTrainer
    from packd.trl import PackedGRPOTrainer
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, "<unk>")),
                                  pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
                      per_device_train_batch_size=batch_rows // accumulation,
                      num_generations=members, gradient_accumulation_steps=accumulation,
                      steps_per_generation=accumulation, max_completion_length=max_completion,
                      use_cpu=True, report_to=[], bf16=False, fp16=False, beta=0.0,
                      activation_checkpointing=False, learning_rate=1e-5)
    kwargs = dict(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                  args=args, train_dataset=Dataset.from_dict({"prompt": ["<unk>"] * 8}),
                  processing_class=tok)
    if kind == "stock":
        return GRPOTrainer(**kwargs)
    return PackedGRPOTrainer(packd_client=packd.Client(address),
                             share_prompt=kind != "packd",
                             micro_batches="trl" if kind == "packd slices" else "auto", **kwargs)


def tokens_forwarded(trainer):
    """The tokens the trainer has forwarded: PackedGRPOTrainer counts its packed streams' rows;
    the stock trainer's forward is wrapped to count each padded micro-batch's [B, P + C]."""
    if hasattr(trainer, "tokens_forwarded"):
        return lambda: trainer.tokens_forwarded
    counted = [0]
    forward = trainer._get_per_token_logps_and_entropies

    def counting(model, input_ids, *args, **kwargs):
        counted[0] += input_ids.numel()
        return forward(model, input_ids, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = counting
    return lambda: counted[0]


def optimizer_step(trainer, batch, accumulation, optimizer):
    """One optimizer step of TRL's: the micro-batches' losses backpropagated, then AdamW."""
    from trl.trainer.utils import shuffle_sequence_dict, split_tensor_dict
    if hasattr(trainer, "split_generation_batch"):
        parts = trainer.split_generation_batch(batch)
    else:
        parts = split_tensor_dict(shuffle_sequence_dict(batch), accumulation)
    trainer.current_gradient_accumulation_steps = accumulation
    total = 0.0
    for inputs in parts:
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
        total += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--prompt", default="192,320", help="MIN,MAX prompt tokens")
    parser.add_argument("--responses", default="16,1024", help="MIN,MAX response tokens")
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps each way (the "
                        "first a warm-up)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--smoke", action="store_true", help="a tiny model and batch")
    args = parser.parse_args()
    prompt = tuple(int(v) for v in args.prompt.split(","))
    responses = tuple(int(v) for v in args.responses.split(","))
    if args.smoke:
        args.groups, args.members, prompt, responses = 2, 4, (6, 12), (2, 16)
        args.hidden, args.layers, args.vocab, args.steps = 64, 2, 128, 2
    torch.set_num_threads(args.threads)
    register_varlen_attention()
    batches = [generation_batch(step, args.vocab, args.groups, args.members, prompt, responses)
               for step in range(args.steps)]
    rows = args.groups * args.members
    active = [int(b["prompt_mask"].sum() + b["completion_mask"].sum()) for b in batches]
    results = {}
    with server(args.address, args.packd, "bench-trl") as address:
        for way in ("stock", "packd", "packd shared", "packd slices"):
            model = model_of(args.vocab, args.hidden, args.layers, torch.float32)
            trainer = trainer_of(way, model, address, rows, args.members, args.accumulation,
                                 responses[1])
            forwarded = tokens_forwarded(trainer)
            optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-5)
            trainer.model.train()
            seconds, losses, tokens = [], [], []
            for batch in batches:
                before = forwarded()
                start = time.perf_counter()
                losses.append(optimizer_step(trainer, batch, args.accumulation, optimizer))
                seconds.append(time.perf_counter() - start)
                tokens.append(forwarded() - before)
            results[way] = (statistics.median(seconds[1:] or seconds), statistics.mean(tokens),
                            losses[0])
    stock_time, stock_tokens, stock_loss = results["stock"]
    print("bench_trl: Qwen 3 (hidden %d, %d layers), float32, %d threads; %d groups x %d, "
          "prompts %d..%d, responses %d..%d, %d micro-batches a step: %d real tokens a step"
          % (args.hidden, args.layers, args.threads, args.groups, args.members, prompt[0],
             prompt[1], responses[0], responses[1], args.accumulation,
             statistics.mean(active)))
    print("| way | tokens forwarded | vs stock | optimizer step (s) | speedup | loss, step 1 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    failed = []
    for way, (sec, tok, loss) in results.items():
        print("| %s | %.0f | %.3f | %.3f | %.2fx | %.6f |"
              % (way, tok, tok / stock_tokens, sec, stock_time / sec, loss))
        if abs(loss - stock_loss) > 1e-5 * max(abs(stock_loss), 1e-6):
            failed.append(way)
    print("(median of %d steps after a warm-up; targets for packd shared: tokens <= 0.4 of "
          "stock's, a step >= 2x as fast)" % max(args.steps - 1, 1))
    if failed:
        print("bench_trl: the first step's loss of %s differs from stock's" % ", ".join(failed),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
