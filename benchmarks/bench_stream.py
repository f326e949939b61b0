"""The streaming step against waiting for the whole batch (docs/performance.md, "The streaming
step"): an RL step is generation, then training, and generation ends with a long tail.

Rollouts "finish" over time, submitted by a rollout worker in its own process: --groups GRPO groups of --members responses, lengths lognormal as in
bench_train.py, each group done when its longest response is (generation time proportional to
tokens, the longest group last, at --generation times the measured training time). A trainer of
bench_train's model (a Qwen 3 from its config, packd_varlen attention) consumes the step two ways:

  wait then train  the whole batch once the last group is done, then PackMicroBatches, each
                   micro-batch trained, the optimizer step;
  streaming        a streaming step opened before generation: each group submitted as it
                   finishes, each micro-batch trained as its wave arrives, the optimizer step
                   once the close's last message brings global_loss_tokens.

Both report the tail (from the last group's end to the optimizer step) and the end to end
(generation plus training); medians over --repeats.

    bench_stream.py --packd build/bin/packd          # the table in docs/performance.md
    bench_stream.py --smoke --packd build/bin/packd  # tiny, float64: both ways' gradients equal
"""
import argparse
import copy
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_step import add_server_arguments, server  # noqa: E402
from bench_train import Rollout, keep_float64, model_of  # noqa: E402

import packd  # noqa: E402
from packd.hf import register_varlen_attention  # noqa: E402


def micro_batch_loss(model, r):
    """Backpropagates one micro-batch's summed token loss; returns it."""
    logits = model(input_ids=r.packed[0][None], position_ids=r.position_ids[None],
                   use_cache=False).logits[0]
    loss = (F.cross_entropy(logits, r.shifted[0].clamp(min=0), reduction="none")
            * r.packed[1].to(logits.dtype)).sum()
    loss.backward()
    return loss.item()


def group_rows(batch, g):
    return [b for b in range(batch.B) if batch.groups[b] == g]


def finish_times(batch, generation):
    """Each group's end, in seconds from the start: proportional to its longest response."""
    longest = {}
    for b in range(batch.B):
        n = int(batch.mask[b].sum()) - batch.prompts[b]
        longest[batch.groups[b]] = max(longest.get(batch.groups[b], 0), n)
    top = max(longest.values())
    return {g: generation * n / top for g, n in longest.items()}


def tail_floor(batch, ends, train):
    """The least tail any streaming trainer has at this speed (the whole batch in `train`
    seconds): the largest of the work arriving from each group's end on, less the time left
    until the last end."""
    tokens = {}
    for b in range(batch.B):
        tokens[batch.groups[b]] = tokens.get(batch.groups[b], 0) + int(batch.mask[b].sum())
    speed = sum(tokens.values()) / train
    last = max(ends.values())
    return max(sum(tokens[h] for h in ends if ends[h] >= e) / speed - (last - e)
               for e in ends.values())


def wait_then_train(model, client, batch, ends, max_tokens):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.zero_grad()
    start = time.monotonic()
    time.sleep(max(ends.values()))  # the last group's end: the batch is whole
    last = time.monotonic()
    step = client.pack_micro_batches([batch.tokens, batch.predicts.to(torch.int64)], batch.mask,
                                     max_tokens, loss_mask=batch.predicts, with_position_ids=True,
                                     layout=packd.Layout(shifts=[(0, -100)]))
    for mb in step:
        micro_batch_loss(model, mb.result)
    packd.scale_gradients(model.parameters(), 1, step.plan.global_loss_tokens)
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    done = time.monotonic()
    micro_batches = step.plan.micro_batches_per_rank
    return done - last, done - start, micro_batches, grads, micro_batches


def rollout_worker(jobs, done, tokens, predicts, mask, groups):
    """A rollout worker in its own process: for each job (address, step id, start, each group's
    end), submits every group at its end (time.monotonic, shared by the processes), then says
    so."""
    for address, step_id, start, ends in iter(jobs.get, None):
        with packd.Client(address) as submitter:
            for g, end in sorted(ends.items(), key=lambda item: item[1]):
                time.sleep(max(0.0, start + end - time.monotonic()))
                rows = [b for b in range(len(groups)) if groups[b] == g]
                submitter.submit_group(step_id, [tokens[rows], predicts[rows].to(torch.int64)],
                                       mask[rows], loss_mask=predicts[rows])
        done.put(time.monotonic())


class RolloutWorkers:
    """The rollout worker process, started once (its imports take seconds) and given each
    streaming step in turn."""

    def __init__(self, batch):
        context = multiprocessing.get_context("spawn")
        self.jobs, self.done = context.Queue(), context.Queue()
        self.process = context.Process(target=rollout_worker, args=(
            self.jobs, self.done, batch.tokens, batch.predicts, batch.mask, batch.groups))
        self.process.start()

    def close(self):
        self.jobs.put(None)
        self.process.join()


def streaming(model, client, batch, ends, max_tokens, workers):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    optimizer.zero_grad()
    layout = packd.Layout(shifts=((0, -100),))
    step = client.open_step(max_tokens, layout=layout, with_position_ids=True)
    stream = client.receive_step(step.step_id, 0)
    start = time.monotonic() + 0.05
    last = start + max(ends.values())  # the last group's end
    workers.jobs.put((step.address, step.step_id, start, ends))

    def controller():
        workers.done.get()  # every group submitted: the batch is complete
        step.close()

    closing = threading.Thread(target=controller)
    closing.start()
    micro_batches = after = 0
    for mb in stream:
        if time.monotonic() > last:
            after += 1  # trained after the last group's end
        if mb.result.total_active:
            micro_batch_loss(model, mb.result)
        micro_batches += 1
    packd.scale_gradients(model.parameters(), 1, stream.global_loss_tokens)
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    done = time.monotonic()
    closing.join()
    return done - last, done - start, micro_batches, grads, after


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_server_arguments(parser)
    parser.add_argument("--groups", type=int, default=128)
    parser.add_argument("--members", type=int, default=4)
    parser.add_argument("--prompt", default="64,256", help="MIN,MAX prompt tokens")
    parser.add_argument("--responses", default="16,1024", help="MIN,MAX response tokens")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--max_tokens", type=int, default=2048, help="the micro-batch budget")
    parser.add_argument("--generation", type=float, default=2.0,
                        help="generation's length, in units of the measured training time "
                             "(RL steps spend most of their time generating)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="also write the figures as one JSON object")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny, in float64: both ways' gradients equal to 1e-9")
    args = parser.parse_args()
    dtype = torch.float32
    if args.smoke:
        args.groups, args.members, args.prompt, args.responses = 4, 2, "4,8", "4,64"
        args.hidden, args.layers, args.vocab, args.max_tokens = 64, 1, 128, 128
        args.repeats, dtype = 1, torch.float64
        keep_float64()
    register_varlen_attention()
    torch.manual_seed(0)
    batch = Rollout(0, args.vocab, args.groups, args.members,
                    tuple(map(int, args.prompt.split(","))),
                    tuple(map(int, args.responses.split(","))))
    initial = model_of(args.vocab, args.hidden, args.layers, dtype)
    initial.config._attn_implementation = "packd_varlen"
    workers = RolloutWorkers(batch)
    with server(args.address, args.packd, "bench-stream") as address, \
            packd.Client(address) as client:
        # The training time alone (no generation), warmed up: the unit of --generation.
        no_wait = {g: 0.0 for g in set(batch.groups)}
        wait_then_train(copy.deepcopy(initial), client, batch, no_wait, args.max_tokens)
        train = statistics.median(
            wait_then_train(copy.deepcopy(initial), client, batch, no_wait, args.max_tokens)[0]
            for _ in range(2))
        ends = finish_times(batch, args.generation * train)
        results = {"wait then train": [], "streaming": []}
        # Each step from the same weights: the ways' gradients are comparable.
        for _ in range(args.repeats):
            results["wait then train"].append(wait_then_train(
                copy.deepcopy(initial), client, batch, ends, args.max_tokens))
            results["streaming"].append(streaming(
                copy.deepcopy(initial), client, batch, ends, args.max_tokens, workers))
    workers.close()
    worst = max(float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))
                for a, b in zip(results["streaming"][0][3], results["wait then train"][0][3]))
    if args.smoke:
        print("streaming / wait then train gradients: %.1e relative" % worst)
        if worst > 1e-9:
            raise SystemExit("the streaming step's gradients differ from the whole batch's")
        return
    print("%d rows (%d groups of %d), %d tokens, budget %d; training alone %.2f s, generation "
          "%.2f s (the last group's end)" % (batch.B, args.groups, args.members, batch.active,
                                             args.max_tokens, train, max(ends.values())))
    print("%-16s %12s %14s %14s %12s" % ("way", "tail (s)", "end to end (s)", "micro-batches",
                                         "in the tail"))
    figures = {}
    for name, runs in results.items():
        tail = statistics.median(r[0] for r in runs)
        total = statistics.median(r[1] for r in runs)
        after = statistics.median(r[4] for r in runs)
        figures[name] = {"tail_s": tail, "end_to_end_s": total, "micro_batches": runs[0][2],
                         "micro_batches_in_tail": after}
        print("%-16s %12.3f %14.3f %14d %12.1f" % (name, tail, total, runs[0][2], after))
    wait, stream = figures["wait then train"], figures["streaming"]
    tail_ratio = stream["tail_s"] / wait["tail_s"]
    total_ratio = stream["end_to_end_s"] / wait["end_to_end_s"]
    floor = tail_floor(batch, ends, train)
    print("streaming / wait then train: tail %.3f (target <= 0.25), end to end %.3f "
          "(target <= 0.8); first steps' gradients %.1e relative (float32)"
          % (tail_ratio, total_ratio, worst))
    print("the tail no streaming trainer of this speed avoids (the work arriving after each "
          "group's end): %.3f s, %.3f of waiting's" % (floor, floor / wait["tail_s"]))
    if args.json:
        figures.update(tail_ratio=tail_ratio, end_to_end_ratio=total_ratio,
                       training_s=train, gradient_difference=worst,
                       tail_floor_s=tail_floor(batch, ends, train))
        with open(args.json, "w") as f:
            json.dump(figures, f)


if __name__ == "__main__":
    main()
