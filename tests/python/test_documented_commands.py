"""Every example command the docs show (README.md and docs/*.md, in code blocks: `python
examples/...` and `accelerate launch ... examples/...`) runs as written from a user's
environment: packd's wheel and its extras' peers installed, no test runner (an import of pytest
fails), nothing of tests/ on the path, from the repository's root, against a packd (the
documented address replaced by the test's). Each must exit 0. On PyPI's stack (TRL, transformers,
accelerate); Debian's skips the commands whose imports it lacks, saying so."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
DOCUMENTED = "127.0.0.1:50051"
# What each example needs beyond packd and torch.
NEEDS = {"train_trl_grpo.py": ("trl", "accelerate"), "train_hf_packed.py": ("transformers",)}

# An import of pytest (or of anything under tests/) fails, as in a user's environment.
BLOCKER = """
import sys
class _NoTests:
    def find_spec(self, name, path=None, target=None):
        if name == "pytest" or name.startswith(("_pytest", "packd_server", "hf_families")):
            raise ImportError("%s is a test-only module: the docs' commands must not need it"
                              % name)
        return None
sys.meta_path.insert(0, _NoTests())
"""


def documented_commands():
    commands = []
    docs = [os.path.join(ROOT, "README.md")] + sorted(
        os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
        if f.endswith(".md"))
    for path in docs:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        fence = None  # the open code block's language, or None outside one
        for line in text.splitlines():
            if line.startswith("```"):
                fence = None if fence is not None else line[3:].strip()
                continue
            if fence in ("", "bash", "sh", "console"):
                line = line.split("#")[0].strip()
                if re.match(r"^(python|accelerate launch) .*examples/\w+\.py", line):
                    commands.append((os.path.relpath(path, ROOT), line))
    return sorted(set(commands))


COMMANDS = documented_commands()


def test_the_docs_show_example_commands():
    assert len(COMMANDS) >= 5, COMMANDS


@pytest.mark.parametrize("where, command", COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_documented_command_runs_as_written(address, tmp_path, where, command):
    script = re.search(r"examples/(\w+\.py)", command).group(1)
    missing = [m for m in NEEDS.get(script, ()) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip("%s is not installed on this stack" % ", ".join(missing))
    words = command.replace(DOCUMENTED, address).split()
    if "--address" not in words:
        words += ["--address", address]
    if words[0] == "python":
        words[0] = sys.executable
    else:  # accelerate launch: torch's launcher, the ranks on the CPU over gloo
        words = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
                 "0"] + words[2:]
    (tmp_path / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PACKD_PEERS_DIR")}
    env["PYTHONPATH"] = str(tmp_path)
    run = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, "%s (%s) exited %d:\n%s\n%s" % (
        command, where, run.returncode, run.stdout[-3000:], run.stderr[-4000:])
