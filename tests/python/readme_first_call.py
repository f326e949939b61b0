"""Runs README.md's first Pack call (the python block under "## A first Pack call") as it is
written, but for the port (a free one, in case 50051 is taken), against a packd started there,
and checks what it printed.

    readme_first_call.py PACKD_BINARY README"""
import contextlib
import importlib.metadata as metadata
import io
import re
import sys

from packd_server import PackdServer, unused_port

binary, readme = sys.argv[1:3]
text = open(readme).read()
section = text[text.index("## A first Pack call"):]
code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
written = re.search(r'"(127\.0\.0\.1:\d+)"', code).group(1)
address = f"127.0.0.1:{unused_port()}"
code = code.replace(written, address)
print("stack: " + ", ".join(f"{p} {metadata.version(p)}"
                            for p in ("torch", "grpcio", "protobuf", "numpy")))
with PackdServer("--listen=" + address, "--device=cpu", binary=binary):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
printed = out.getvalue()
print(printed, end="")
# print(r.cu_seqlens, r.max_seqlen, r.position_ids, r.last_index) for the README's mask.
expected = ("tensor([0, 2, 5], dtype=torch.int32) 3 tensor([0, 1, 0, 1, 2]) tensor([1, 2])\n")
assert printed == expected, f"the README's call printed {printed!r}, not {expected!r}"
print("the README's first Pack call works in a fresh venv")
