"""examples/train_parallel.py as a test: context-parallel (dual chunks) and Ulysses (contiguous
slices) training on packd's step, with documents, padding and shifted labels, with and without
fixed shapes, equals the unpacked model in float64 to 1e-9 relative: losses, the hidden-state
gradient (through RemotePackOp's Scatter) and every parameter's gradient."""
import pytest

import train_parallel


@pytest.mark.parametrize("mode, size", [("cp", 2), ("cp", 3), ("sp", 2), ("sp", 3)])
@pytest.mark.parametrize("fixed", [False, True])
def test_parallel_training_equals_unpacked_training(client, mode, size, fixed):
    lines = []
    worst = train_parallel.train(client, mode=mode, size=size, fixed=fixed, steps=2,
                                 check=True, log=lines.append)
    print("\n".join(lines))
    assert len(lines) == 2
    assert max(worst) <= 1e-9, lines
