"""torch's x[mask] and index_copy_ on the GPU for the shapes gpu_check times, with CUDA events.
Run by run_gpu_checks.sh when torch with CUDA is present."""
import torch


def median_ms(fn, reps=20):
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def mask_for(B, S, density, prefix, gen):
    if not prefix:
        return torch.rand(B, S, generator=gen, device="cuda") < density
    frac = (density * (0.5 + torch.rand(B, generator=gen, device="cuda"))).clamp(max=1.0)
    if density >= 1.0:
        frac = torch.ones_like(frac)
    lens = (frac * S).long()
    return torch.arange(S, device="cuda").expand(B, S) < lens[:, None]


gen = torch.Generator(device="cuda").manual_seed(1234)
print(f"{'mask':6} {'B':>5} {'S':>6} {'H':>5} {'dens':>5} {'x[mask] ms':>11} {'index_copy_ ms':>15}")
configs = [(16, 1024, 4096, d, p) for p in (True, False) for d in (0.1, 0.3, 1.0)]
configs += [(16, 8192, 4096, d, False) for d in (0.1, 0.3, 1.0)]
for B, S, H, density, prefix in configs:
    x = torch.ones(B, S, H, dtype=torch.bfloat16, device="cuda")
    mask = mask_for(B, S, density, prefix, gen)
    packed = x[mask]
    pack_ms = median_ms(lambda: x[mask])

    def scatter():
        dense = torch.zeros_like(x)
        dense.view(B * S, H).index_copy_(0, mask.flatten().nonzero().squeeze(1), packed)

    print(f"{'prefix' if prefix else 'random':6} {B:5} {S:6} {H:5} {density:5.2f} "
          f"{pack_ms:11.3f} {median_ms(scatter):15.3f}")
