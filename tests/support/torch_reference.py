"""What the Python test suites compare packd against: random tensors of every dtype (random
bytes, so NaN payloads and -0.0 occur), torch's own scatter as the reference, and byte-exact
comparison.

    x = random_tensor(torch.bfloat16, (4, 16, 8))
    assert same(reference_scatter(x[mask != 0], mask, x), dense)
"""
import torch

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]


def random_tensor(dtype, shape, gen=None):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=gen)
    return data.view(dtype).reshape(shape)


def raw(t):
    """A tensor's bytes, for exact comparison (NaN payloads and -0.0 included)."""
    t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def bits(t):
    """An integer view of a tensor's bits: torch's index_put_ with a single value converts it
    through a scalar (NaN payloads and signs are lost); on integers indexing only moves bits."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32,
                                8: torch.int64}[t.element_size()])


def reference_scatter(packed, mask, like):
    """dense with like's shape and dtype: zeros, and packed's rows at mask's active positions."""
    dense = torch.zeros_like(bits(like))
    dense[mask != 0] = bits(packed)
    return dense.view(like.dtype)


def same(a, b):
    """Same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
