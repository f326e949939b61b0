"""packd.trl's streaming form (docs/trl.md, "Streaming"): rollout workers in their own processes
score each group and submit it to a streaming step as soon as it is scored (with the policy
version that generated it and a group key, so a retry is taken once), while every trainer rank
receives its own micro-batches and backpropagates each one's summed token loss; the gradients
are scaled by world_size / the step's global token count before they are clipped."""
import dataclasses
import math
import multiprocessing
import os
import queue
import threading
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

import packd
from packd.layout import Layout, SharedPrefix

# Loss types whose normaliser is the generation batch's token count (TRL's num_items_in_batch):
# the streaming step's global_loss_tokens.
STREAMED_LOSSES = ("dapo", "cispo", "vespo")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The weights a rollout must generate with: `version` (the trainer's optimizer steps so
    far) and, with Streaming.weights_dir, `weights`: the file of that version's state_dict."""
    version: int
    weights: Optional[str] = None


@dataclasses.dataclass
class ScoredGroup:
    """One prompt's group, as a rollout function returns it: the prompt's token ids, each of the
    num_generations completions' token ids (those TRL's completion mask keeps: up to and with
    the first EOS), each completion's reward, and the policy version that generated it (default:
    the one asked for)."""
    prompt_ids: Sequence[int]
    completion_ids: Sequence[Sequence[int]]
    rewards: Sequence[float]
    policy_version: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class Streaming:
    """PackedGRPOTrainer(streaming=...): train from a streaming step. rollout(example, n,
    policy) -> ScoredGroup is called in `processes` worker processes (started with "spawn": a
    module-level function or a functools.partial of one), once per prompt of each generation
    batch; max_tokens: each micro-batch's token budget; max_staleness: how many versions older
    than the trainer's a group may be (older ones are refused and counted in the metric
    packd/stale_groups); weights_dir: where the trainer saves each version's state_dict for the
    rollouts (Policy.weights), none when None; wave_fill: the streaming step's (0: packd's
    default)."""
    rollout: Callable[[Dict[str, Any], int, Policy], ScoredGroup]
    processes: int = 2
    max_tokens: int = 4096
    max_staleness: int = 0
    weights_dir: Optional[str] = None
    wave_fill: float = 0.0


def group_advantages(rewards: Sequence[float], scale_rewards: str) -> torch.Tensor:
    """A group's advantages as TRL computes them (float32): the reward less the group's mean,
    over the group's standard deviation (Bessel's) plus 1e-4 unless scale_rewards is "none"."""
    from trl.trainer.utils import nanstd
    r = torch.tensor([float(v) for v in rewards], dtype=torch.float32)
    advantages = r - torch.nanmean(r)
    if scale_rewards != "none":
        advantages = advantages / (nanstd(r) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


def group_tensors(group: ScoredGroup, n: int, scale_rewards: str
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, List[int]]:
    """A scored group as the streaming step takes it: token ids [n, S] (the prompt, then the
    completion), each row's advantage on every position [n, S], the mask [n, S], the prompt's
    length on each row. ValueError for a group that is not n completions of at least a token
    each after a prompt of at least a token."""
    prompt = [int(t) for t in group.prompt_ids]
    completions = [[int(t) for t in c] for c in group.completion_ids]
    if not prompt or len(completions) != n or len(group.rewards) != n or not all(completions):
        raise ValueError(
            "packd.trl: a rollout returned %d completions and %d rewards after a prompt of %d "
            "tokens; a group is num_generations = %d completions of at least one token each, "
            "after a prompt of at least one" % (len(completions), len(group.rewards),
                                               len(prompt), n))
    width = len(prompt) + max(len(c) for c in completions)
    ids = torch.zeros(n, width, dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for row, completion in enumerate(completions):
        tokens = prompt + completion
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = True
    advantages = group_advantages(group.rewards, scale_rewards)[:, None].expand(n, width)
    return ids, advantages.contiguous(), mask, [len(prompt)] * n


def stream_layout() -> Layout:
    """The step's layout: each group's prompt once (its token ids must agree across the group),
    the targets (the completion tokens) and each one's advantage taken by the shifts."""
    return Layout(shared_prefix=SharedPrefix((), (), (0,)), shifts=[(0, 0), (1, 0)])


def _worker(tasks: Any, reports: Any, rollout: Callable) -> None:
    """A rollout worker: per task, the group generated and scored by `rollout`, then submitted;
    one report per task: (key, "taken" | "stale" | "error", detail)."""
    clients: Dict[str, packd.Client] = {}
    while True:
        task = tasks.get()
        if task is None:
            return
        address, step_id, key, example, n, policy, max_staleness, scale_rewards = task
        try:
            group = rollout(example, n, policy)
            ids, advantages, mask, prefix = group_tensors(group, n, scale_rewards)
            version = policy.version if group.policy_version is None else group.policy_version
            if address not in clients:
                clients[address] = packd.Client(address)
            try:
                clients[address].submit_group(step_id, [ids, advantages], mask,
                                              policy_version=version, prefix_lengths=prefix,
                                              group_key=key)
            except packd.PackdError as e:
                if version < policy.version - max_staleness and "policy version" in str(e):
                    reports.put((key, "stale", str(e)))
                    continue
                raise
            reports.put((key, "taken", ScoredGroup(
                [int(t) for t in group.prompt_ids],
                [[int(t) for t in c] for c in group.completion_ids],
                [float(r) for r in group.rewards], version)))
        except Exception:  # noqa: BLE001 - carried to the trainer, which raises it
            reports.put((key, "error", traceback.format_exc()))


class Rollouts:
    """The worker processes of a streaming trainer (rank 0's), started on first use."""

    def __init__(self, streaming: Streaming) -> None:
        self.streaming = streaming
        context = multiprocessing.get_context("spawn")
        self.tasks, self.reports = context.Queue(), context.Queue()
        self.workers = [context.Process(target=_worker, daemon=True, name="packd-rollout-%d" % i,
                                        args=(self.tasks, self.reports, streaming.rollout))
                        for i in range(max(int(streaming.processes), 1))]
        for worker in self.workers:
            worker.start()

    def run(self, address: str, step_id: str, examples: Sequence[Dict[str, Any]], n: int,
            policy: Policy, scale_rewards: str) -> None:
        for i, example in enumerate(examples):
            self.tasks.put((address, step_id, "%s/%d" % (step_id, i), example, n, policy,
                            self.streaming.max_staleness, scale_rewards))

    def reports_of(self, step_id: str, count: int) -> List[Tuple[str, str, Any]]:
        """The `count` reports of step `step_id`'s tasks, as they come; RuntimeError naming a
        worker that died."""
        out = []
        while len(out) < count:
            try:
                report = self.reports.get(timeout=1.0)
            except queue.Empty:
                dead = [w.name for w in self.workers if not w.is_alive()]
                if dead:
                    raise RuntimeError("packd.trl: rollout worker %s ended" % ", ".join(dead))
                continue
            if report[0].startswith(step_id + "/"):
                out.append(report)
        return out

    def stop(self) -> None:
        for _ in self.workers:
            self.tasks.put(None)
        for worker in self.workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.terminate()


class StepCloser(threading.Thread):
    """Rank 0's: closes the step once every group of it was reported (taken, stale or failed);
    cancels it when a rollout failed, so that every rank's stream ends."""

    def __init__(self, rollouts: Rollouts, controller: Any, count: int) -> None:
        super().__init__(daemon=True, name="packd-step-closer")
        self.rollouts, self.controller, self.count = rollouts, controller, count
        self.reports: List[Tuple[str, str, Any]] = []
        self.failure: Optional[str] = None

    def run(self) -> None:
        try:
            self.reports = self.rollouts.reports_of(self.controller.step_id, self.count)
            failed = [detail for _, kind, detail in self.reports if kind == "error"]
            if failed:
                self.failure = failed[0]
                self.controller.cancel()
            else:
                self.controller.close()
        except Exception:  # noqa: BLE001 - raised by the trainer after its stream ends
            self.failure = traceback.format_exc()
            self.controller.cancel()

    def kinds(self, kind: str) -> List[Any]:
        return [detail for _, k, detail in self.reports if k == kind]


@dataclasses.dataclass
class StepReport:
    """What rank 0's rollouts reported of a step: the groups taken, in the order their reports
    came (their arrival order), with their indices in the generation batch, and the count
    refused as stale."""
    groups: List[ScoredGroup]
    arrival: List[int]
    stale: int

    @staticmethod
    def of(closer: StepCloser) -> "StepReport":
        taken = [(key, group) for key, kind, group in closer.reports if kind == "taken"]
        return StepReport([group for _, group in taken],
                          [int(key.rsplit("/", 1)[1]) for key, _ in taken],
                          len(closer.kinds("stale")))

    def metrics(self) -> Dict[str, float]:
        """TRL's metrics of the step's groups, and packd's counts."""
        rewards = [r for g in self.groups for r in g.rewards]
        lengths = [len(c) for g in self.groups for c in g.completion_ids]
        return {"packd/groups": float(len(self.groups)), "packd/stale_groups": float(self.stale),
                "reward": mean(rewards), "completions/mean_length": mean(lengths)}


def sum_gradients(parameters: Any) -> None:
    """Every gradient summed over the ranks, in one all-reduce."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def publish_weights(model: torch.nn.Module, directory: str, version: int,
                    max_staleness: int) -> str:
    """Saves the model's weights (merged_state_dict) as version `version` in `directory`
    (written whole, then renamed) and removes versions older than a rollout may still use;
    returns its path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "policy-%d.pt" % version)
    torch.save(merged_state_dict(model), path + ".tmp")
    os.replace(path + ".tmp", path)
    stale = version - max_staleness - 1
    old = os.path.join(directory, "policy-%d.pt" % stale)
    if stale >= 0 and os.path.exists(old):
        os.remove(old)
    return path


def merged_state_dict(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """The weights a rollout generates with: a PEFT model's as its base model's state_dict, each
    LoRA layer's active adapters merged into its weight (W + the adapter's delta, as PEFT's
    merge computes it, without changing the model), so that a plain model of the base's class
    loads them; any other model's state_dict."""
    if not hasattr(model, "peft_config"):
        return model.state_dict()
    from peft.tuners.lora import LoraLayer
    base = model.get_base_model()
    merged = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight.detach()
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).detach()
            merged[name + ".weight"] = weight
    state = {}
    for key, value in base.state_dict().items():
        if ".lora_" not in key:
            state[key.replace(".base_layer.", ".")] = value
    state.update(merged)
    return state


def streamed_inputs(result: Any, processes: int) -> Dict[str, Any]:
    """A received micro-batch as TRL's _compute_loss reads it: each row's completion ids and
    mask [B, C] (right-padded), its advantage [B], a one-token placeholder prompt (the forward
    uses the packed stream), and num_items_in_batch = the processes, so that TRL's token-sum
    normaliser is 1: the summed token loss, scaled by the global count later."""
    bounds = result.shared.target_cu_seqlens
    lengths = bounds[1:] - bounds[:-1]
    rows = len(lengths)
    width = max(int(lengths.max()) if rows else 1, 1)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    ids = torch.zeros(rows, width, dtype=torch.long).masked_scatter(mask, result.shifted[0])
    advantages = result.shifted[1][bounds[:-1].clamp(max=max(len(result.shifted[1]) - 1, 0))]
    return {"prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
            "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
            "completion_ids": ids, "completion_mask": mask.long(), "advantages": advantages,
            "num_items_in_batch": torch.tensor(float(processes))}


def check_streaming(args: Any, share_prompt: bool) -> None:
    """ValueError naming each setting of a GRPOConfig that a streaming trainer cannot honour
    (checked before TRL builds anything)."""
    wrong = []
    if args.gradient_accumulation_steps != 1 or (args.steps_per_generation or 1) != 1:
        wrong.append("gradient_accumulation_steps = steps_per_generation = 1 (packd's "
                     "micro-batches run inside one training step)")
    if args.num_iterations != 1:
        wrong.append("num_iterations = 1")
    if args.loss_type not in STREAMED_LOSSES:
        wrong.append("loss_type one of %s (normalised by the global token count), not %r"
                     % (", ".join(STREAMED_LOSSES), args.loss_type))
    if args.scale_rewards not in ("group", "none"):
        wrong.append("scale_rewards 'group' or 'none' (a group is scored alone)")
    if args.use_vllm or args.off_policy_mask_threshold is not None:
        wrong.append("no vLLM and no off-policy mask (rollouts bring no sampling log-probs)")
    if args.entropy_coef != 0.0 or args.use_adaptive_entropy or args.top_entropy_quantile < 1:
        wrong.append("no entropy bonus or mask (a per-micro-batch mean)")
    if not share_prompt:
        wrong.append("share_prompt = True (a streamed group brings its prompt once)")
    if wrong:
        raise ValueError("packd.trl: streaming needs " + "; ".join(wrong))


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
