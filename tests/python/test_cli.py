"""`python -m packd` (info, health, plan) against a real server, the package's version against
the server's and the installed distribution's, and py.typed shipped."""
import importlib.metadata
import inspect
import json
import os
import subprocess
import sys

import packd


def run(address, *args):
    return subprocess.run([sys.executable, "-m", "packd", f"--address={address}", *args],
                          capture_output=True, text=True, timeout=60)


def test_help_names_every_command():
    r = subprocess.run([sys.executable, "-m", "packd", "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for command in ("info", "health", "plan"):
        assert command in r.stdout


def test_info_is_the_servers_as_json(address):
    r = run(address, "info")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    with packd.Client(address) as client:
        assert info["version"] == client.info().version


def test_health_is_serving(address):
    r = run(address, "health")
    assert r.returncode == 0 and r.stdout.strip() == "SERVING", (r.stdout, r.stderr)
    r = run(address, "health", "--service=no.such.Service")
    assert r.returncode != 0


def test_plan_prints_the_servers_plan(address):
    r = run(address, "plan", "--lengths=900,300,2048,50", "--max-tokens=2048", "--ranks=2")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    with packd.Client(address) as client:
        want = packd.Plan.of(client.plan_micro_batches([900, 300, 2048, 50], 2048,
                                                       plan=packd.PlanOptions(num_ranks=2)))
    assert plan["micro_batches_per_rank"] == want.micro_batches_per_rank
    assert plan["global_loss_tokens"] == want.global_loss_tokens
    assert [m["samples"] for m in plan["micro_batches"]] == [m.samples for m in want.micro_batches]


def test_bad_input_is_the_servers_message_and_exit_2(address):
    r = run(address, "plan", "--lengths=5000", "--max-tokens=0")
    assert r.returncode == 2 and r.stderr.strip(), r.stderr
    r = run("127.0.0.1:1", "--timeout=2", "info")
    assert r.returncode == 2


def test_versions_agree(address):
    with packd.Client(address) as client:
        assert packd.__version__ == client.info().version
    assert packd.__version__ == importlib.metadata.version("packd")


def test_the_package_is_typed():
    assert os.path.exists(os.path.join(os.path.dirname(packd.__file__), "py.typed"))


def _public_callables():
    """(name, function) for every public function and method of the public API: packd's
    __all__, packd.flash_attn and packd.hf."""
    import packd.flash_attn
    import packd.hf
    dunders = {"__init__", "__call__", "__enter__", "__exit__", "__iter__"}
    objects = [(n, getattr(packd, n)) for n in packd.__all__ if n != "__version__"]
    for module in (packd.flash_attn, packd.hf):
        objects += [(f"{module.__name__}.{n}", getattr(module, n)) for n in module.__all__]
    for name, obj in objects:
        if inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                if inspect.isfunction(member) and (not attr.startswith("_") or attr in dunders):
                    yield f"{name}.{attr}", member
        elif inspect.isfunction(obj):
            yield name, obj


def test_the_public_api_is_annotated():
    missing = []
    for name, fn in _public_callables():
        signature = inspect.signature(fn)
        for p in signature.parameters.values():
            if p.name not in ("self", "cls") and p.annotation is inspect.Parameter.empty:
                missing.append(f"{name}({p.name})")
        if signature.return_annotation is inspect.Signature.empty:
            missing.append(f"{name} -> ?")
    assert not missing, "not annotated: " + ", ".join(missing)
    assert len(list(_public_callables())) > 20
