"""Rollout functions for packd.trl's streaming tests: groups made in code from the prompt alone
(the same group whatever process or arrival order makes it), with rewards in code."""
import random
import time

from packd.trl import ScoredGroup

from train_trl_grpo import WORDS


def scripted(example, n, policy, *, order_seed=0, delay=0.0, stale=(), fail=()):
    """The prompt's group: n completions of 1 to 6 words drawn from the prompt's own seed,
    those shorter than 6 ending with EOS, each rewarded by its word numbers modulo 7. It
    arrives after a pause that order_seed draws (so that each seed gives another arrival order),
    claims the policy version before the one asked when its prompt is in `stale`, and raises
    when it is in `fail`."""
    prompt = example["prompt"]
    if prompt in fail:
        raise RuntimeError("the rollout of %r failed" % prompt)
    rng = random.Random(prompt)
    completions = []
    for _ in range(n):
        length = rng.randint(1, 6)
        words = [rng.randrange(3, len(WORDS)) for _ in range(length)]
        if length < 6:
            words[-1] = 1
        completions.append(words)
    rewards = [float(sum(c) % 7) for c in completions]
    time.sleep(delay * random.Random("%d/%s" % (order_seed, prompt)).random())
    return ScoredGroup([WORDS.index(w) for w in prompt.split()], completions, rewards,
                       policy.version - 1 if prompt in stale else None)
