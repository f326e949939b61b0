"""Fine-tuning a transformers model on packd's step, through packd's varlen attention.

A transformers causal LM (a tiny Qwen 3 built from its config, random weights, or --model a
checkpoint you have) is trained a few AdamW steps on a corpus of documents of mixed lengths,
several to a row (segment ids), with a prompt part that has no loss. One PackMicroBatches call
per step plans the batch over data-parallel ranks under a token budget and packs every
micro-batch into one row: the token ids, position ids that restart at every document, next-token
labels that stop at every document's end, and the loss mask. The model runs with
attn_implementation="packd_varlen" (packd.hf.register_varlen_attention), which finds each
document from the position ids and attends within it, on any device, without flash-attn. Each
micro-batch's summed token loss is divided by the plan's one global_loss_tokens (times the
ranks: data-parallel training averages gradients over ranks).

    python examples/train_hf_packed.py --address 127.0.0.1:50051           # train, print losses
    python examples/train_hf_packed.py --address 127.0.0.1:50051 --check   # and compare

--check trains a copy of the model beside it, in float64, on the same documents padded (each
document a row of a padded batch, transformers' own SDPA attention, one mean over the loss
tokens), and requires equal losses and gradients after every step, to 1e-9 relative. It also
shows the quiet bug: a mean taken per micro-batch gives other gradients.

Needs transformers (5.x): pip install transformers.
"""
import copy
import sys

import torch
import torch.nn.functional as F

import packd
from packd.hf import packed_row, register_varlen_attention

from train_packed import (average_over_ranks, backward_next_tokens, example_parser, report,
                          train_beside)

VOCAB = 61  # train_packed's corpus draws its tokens from range(VOCAB)


def tiny_qwen3():
    """A 2-layer Qwen 3 (hidden 64, 4 heads over 2 key-value heads), random weights."""
    from transformers import AutoModelForCausalLM, Qwen3Config
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def packed_step(model, client, batch, *, num_ranks, max_tokens, per_micro_batch_mean=False):
    """One step's gradients from packd's micro-batches through packd_varlen; returns the step's
    loss (the global token mean). per_micro_batch_mean=True divides each micro-batch by its own
    loss tokens instead (the bug)."""
    tokens, mask, segments, loss_mask = batch
    step = client.pack_micro_batches([tokens, loss_mask.to(torch.int64)], mask, max_tokens,
                                     plan=packd.PlanOptions(num_ranks=num_ranks),
                                     layout=packd.Layout(shifts=[(0, -100)]), loss_mask=loss_mask,
                                     segment_ids=segments, with_position_ids=True)
    plan = step.plan
    total = 0.0
    for mb in step:
        r = mb.result
        with packed_row(r, model) as kwargs:  # position ids, cu_seq_lens_q/k, no cache
            logits = model(input_ids=r.packed[0][None], **kwargs).logits[0]
        total += backward_next_tokens(logits, r, plan, num_ranks, per_micro_batch_mean)
    average_over_ranks(model, num_ranks)
    return total


def padded_step(model, batch):
    """The reference: every document a row of a padded batch (right padding, an attention mask),
    the loss the mean over all loss tokens."""
    tokens, mask, segments, loss_mask = batch
    docs = []
    for b in range(tokens.shape[0]):
        for k in segments[b][mask[b]].unique().tolist():
            where = mask[b] & (segments[b] == k)
            docs.append((tokens[b][where], loss_mask[b][where]))
    width = max(len(d) for d, _ in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    attention = torch.zeros(len(docs), width, dtype=torch.long)
    weights = torch.zeros(len(docs), width, dtype=torch.bool)
    for n, (d, w) in enumerate(docs):
        ids[n, :len(d)], attention[n, :len(d)], weights[n, :len(d)] = d, 1, w
    logits = model(input_ids=ids, attention_mask=attention, use_cache=False).logits
    # The prediction at s is of token s + 1; loss_mask is never set at a document's last token.
    labels = torch.roll(ids, -1, dims=1)
    token_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    w = weights.flatten().to(logits.dtype)
    loss = (token_loss * w).sum() / w.sum()
    loss.backward()
    return loss.item()


def train(client, model=None, steps=3, num_ranks=4, max_tokens=96, check=False, log=print):
    """Trains `model` (default: tiny_qwen3()) for `steps`; with `check`, in float64 beside the
    padded reference. Returns the largest relative differences of losses and gradients (0
    without check) and of the per-micro-batch mean's gradients on the first step."""
    register_varlen_attention()
    model = model if model is not None else tiny_qwen3()
    reference = None
    if check:
        model = model.double()
        reference = copy.deepcopy(model)
        reference.config._attn_implementation = "sdpa"
    model.config._attn_implementation = "packd_varlen"

    def packed(m, batch, per_micro_batch_mean=False):
        return packed_step(m, client, batch, num_ranks=num_ranks, max_tokens=max_tokens,
                           per_micro_batch_mean=per_micro_batch_mean)

    return train_beside(model, reference, packed, padded_step, steps,
                        lambda params: torch.optim.AdamW(params, lr=1e-3), log, "padded")


def main(argv=None):
    parser = example_parser(__doc__.split("\n")[0], ranks=4, max_tokens=96)
    parser.add_argument("--model", help="a transformers causal LM to load (default: a tiny "
                        "Qwen 3 from its config); its vocabulary must cover the corpus' ids")
    args = parser.parse_args(argv)
    model = None
    if args.model:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.model)
    with packd.Client(args.address) as client:
        loss, grad, bug = train(client, model, args.steps, args.ranks, args.max_tokens,
                                args.check)
    return report(loss, grad, bug, "padded") if args.check else 0


if __name__ == "__main__":
    sys.exit(main())
