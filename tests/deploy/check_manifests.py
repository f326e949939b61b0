"""Renders every kustomize overlay under deploy/k8s (kubectl kustomize, else kustomize build) and
checks the result:
the image and its tag, probes aimed at ports the flags open, requests and limits set and
--max_message_bytes within them, the security context, and labels and selectors that match.

    /usr/bin/python3 tests/deploy/check_manifests.py [deploy/k8s]

Exit 0 when every overlay passes, 1 with the failures listed, 77 (skipped) without either."""
import os
import re
import shutil
import subprocess
import sys
import tempfile

import yaml

# overlay -> the image every container must run
OVERLAYS = {
    "cpu": "packd:0.1.0",
    "gpu": "packd:0.1.0-cuda",
    "tls": "packd:0.1.0",
    "node-local": "packd:0.1.0",
}
WORKLOADS = ("Deployment", "DaemonSet")
UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9}


def memory_bytes(text):
    m = re.fullmatch(r"(\d+)([KMGT]i?)?", str(text))
    if not m:
        raise ValueError(f"memory quantity {text!r}")
    return int(m.group(1)) * UNITS.get(m.group(2) or "", 1)


def flags(container):
    out = {}
    for arg in container.get("args", []):
        if arg.startswith("--") and "=" in arg:
            name, value = arg[2:].split("=", 1)
            out[name] = value
    return out


def port_of(address):
    """The TCP port of a HOST:PORT flag value, None for a unix socket."""
    if address.startswith("unix:"):
        return None
    return int(address.rsplit(":", 1)[1])


def subset(small, big):
    return all(big.get(k) == v for k, v in small.items())


def check_container(where, c, image, problems):
    def fail(message):
        problems.append(f"{where}: {message}")

    if c.get("image") != image:
        fail(f"image {c.get('image')!r}, expected {image!r}")
    f = flags(c)
    tls = "tls_cert_file" in f
    listen = port_of(f.get("listen", "127.0.0.1:50051"))
    health = port_of(f["health_listen"]) if "health_listen" in f else None
    plaintext_ports = {p for p in (None if tls else listen, health) if p is not None}
    declared = {p["containerPort"] for p in c.get("ports", [])}
    # A streaming step's controller is given the replica's own address behind the headless
    # Service: the pod IP on the gRPC port.
    if c.get("ports") and listen is not None:
        want = f"$(POD_IP):{listen}"
        if f.get("advertise_address") != want:
            fail(f"--advertise_address={f.get('advertise_address')}, expected {want}")
        env = {e.get("name"): e for e in c.get("env", [])}
        field = env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {})
        if field.get("fieldPath") != "status.podIP":
            fail("POD_IP is not the pod's IP (env valueFrom fieldRef status.podIP)")
    for name in ("listen", "health_listen", "metrics_listen"):
        if name in f and port_of(f[name]) is not None and port_of(f[name]) not in declared:
            fail(f"--{name}={f[name]} opens a port the container does not declare")
    for probe_name in ("livenessProbe", "readinessProbe"):
        probe = c.get(probe_name)
        if probe is None:
            fail(f"no {probe_name}")
            continue
        if "grpc" not in probe:
            fail(f"{probe_name} is not a gRPC probe")
            continue
        port = probe["grpc"]["port"]
        if port not in plaintext_ports:
            fail(f"{probe_name} asks port {port}, but the plaintext gRPC ports the flags open "
                 f"are {sorted(plaintext_ports)}" + (" (TLS is on: use --health_listen)"
                                                     if tls else ""))
        want = "" if probe_name == "livenessProbe" else "packd.v1.PackService"
        if probe["grpc"].get("service", "") != want:
            fail(f"{probe_name} asks service {probe['grpc'].get('service')!r}, not {want!r}")
    resources = c.get("resources", {})
    for kind in ("requests", "limits"):
        for what in ("cpu", "memory"):
            if what not in resources.get(kind, {}):
                fail(f"resources.{kind}.{what} is not set")
    limit = resources.get("limits", {}).get("memory")
    if limit is not None:
        message = int(f.get("max_message_bytes", 1 << 30))
        # The default budget is half the limit; the largest call is admitted for 3x its size.
        if 6 * message > memory_bytes(limit):
            fail(f"--max_message_bytes={message} is over a sixth of the memory limit {limit}")
    if f.get("log_format") != "json":
        fail("--log_format is not json (log collectors read one JSON object a line)")
    sc = c.get("securityContext", {})
    if sc.get("readOnlyRootFilesystem") is not True:
        fail("securityContext.readOnlyRootFilesystem is not true")
    if sc.get("allowPrivilegeEscalation") is not False:
        fail("securityContext.allowPrivilegeEscalation is not false")


def check_overlay(render, root, overlay, image, quiet=False):
    """render: the command that renders a kustomization folder (kubectl kustomize, or
    kustomize build)."""
    rendered = subprocess.run([*render, os.path.join(root, "overlays", overlay)],
                              capture_output=True, text=True)
    if rendered.returncode != 0:
        return [f"{overlay}: {' '.join(render)} failed: {rendered.stderr.strip()}"]
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    problems = []
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    if not workloads:
        problems.append(f"{overlay}: no Deployment or DaemonSet")
    for w in workloads:
        where = f"{overlay}: {w['kind']} {w['metadata']['name']}"
        spec = w["spec"]
        template_labels = spec["template"]["metadata"].get("labels", {})
        if not subset(spec["selector"]["matchLabels"], template_labels):
            problems.append(f"{where}: selector {spec['selector']['matchLabels']} does not "
                            f"match the pod labels {template_labels}")
        pod = spec["template"]["spec"]
        psc = pod.get("securityContext", {})
        if psc.get("runAsNonRoot") is not True or not psc.get("runAsUser"):
            problems.append(f"{where}: the pod does not run as a non-root user")
        grace = pod.get("terminationGracePeriodSeconds", 30)
        for c in pod["containers"]:
            check_container(f"{where} container {c['name']}", c, image, problems)
            drain = int(flags(c).get("drain_seconds", 30))
            if grace <= drain:
                problems.append(f"{where}: terminationGracePeriodSeconds {grace} is not above "
                                f"--drain_seconds {drain}")
    pods = [w["spec"]["template"]["metadata"].get("labels", {}) for w in workloads]
    for d in docs:
        where = f"{overlay}: {d['kind']} {d['metadata']['name']}"
        if d["kind"] == "Service":
            if not any(subset(d["spec"]["selector"], labels) for labels in pods):
                problems.append(f"{where}: selector {d['spec']['selector']} matches no pod")
        elif d["kind"] == "PodDisruptionBudget":
            if not any(subset(d["spec"]["selector"]["matchLabels"], labels) for labels in pods):
                problems.append(f"{where}: selector matches no pod")
        elif d["kind"] == "HorizontalPodAutoscaler":
            target = d["spec"]["scaleTargetRef"]
            if not any(w["kind"] == target["kind"] and w["metadata"]["name"] == target["name"]
                       for w in workloads):
                problems.append(f"{where}: scales {target['kind']} {target['name']}, "
                                f"which the overlay does not have")
    if overlay == "cpu":
        kinds = {d["kind"] for d in docs}
        for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget"):
            if kind not in kinds:
                problems.append(f"{overlay}: no {kind}")
    if overlay in ("cpu", "gpu", "tls"):
        if not any(d["kind"] == "Service" and d["spec"].get("clusterIP") == "None" for d in docs):
            problems.append(f"{overlay}: no headless Service for gRPC clients")
    if overlay == "gpu":
        for w in workloads:
            for c in w["spec"]["template"]["spec"]["containers"]:
                if flags(c).get("device") != "cuda:0":
                    problems.append(f"{overlay}: container {c['name']} is not on --device=cuda:0")
                if str(c["resources"]["limits"].get("nvidia.com/gpu")) != "1":
                    problems.append(f"{overlay}: container {c['name']} asks no nvidia.com/gpu")
    if not quiet:
        print(f"{overlay}: {len(docs)} objects, " + ("ok" if not problems else
                                                     f"{len(problems)} problems"))
    return problems


# Mistakes the checks must catch: (overlay, file under deploy/k8s, text, replacement, expected
# words in a failure).
MUTATIONS = [
    ("tls", "overlays/tls/tls.yaml", "grpc: {port: 50052, service: \"\"}",
     "grpc: {port: 50051, service: \"\"}", "TLS is on"),
    ("cpu", "base/deployment.yaml", "limits: {cpu: \"8\", memory: 8Gi}", "limits: {cpu: \"8\"}",
     "resources.limits.memory"),
    ("cpu", "base/deployment.yaml", "--max_message_bytes=1073741824",
     "--max_message_bytes=4294967296", "a sixth of the memory limit"),
    ("gpu", "overlays/gpu/kustomization.yaml", "0.1.0-cuda", "0.1.0", "expected 'packd:0.1.0-cuda'"),
    ("cpu", "base/service.yaml", "  clusterIP: None\n", "", "headless"),
    ("cpu", "overlays/cpu/pdb.yaml", "matchLabels: {app: packd}", "matchLabels: {app: pakd}",
     "matches no pod"),
    ("node-local", "overlays/node-local/daemonset.yaml", "readOnlyRootFilesystem: true",
     "readOnlyRootFilesystem: false", "readOnlyRootFilesystem"),
    ("gpu", "overlays/gpu/gpu.yaml", "\"--log_format=json\"", "\"--log_format=text\"",
     "--log_format is not json"),
]


def self_test(render, root):
    """Each mutation of a copy of deploy/k8s must be reported."""
    problems = []
    for overlay, path, old, new, words in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            copy = os.path.join(tmp, "k8s")
            shutil.copytree(root, copy)
            with open(os.path.join(copy, path)) as f:
                text = f.read()
            if old not in text:
                problems.append(f"self-test: {path} no longer holds {old!r}")
                continue
            with open(os.path.join(copy, path), "w") as f:
                f.write(text.replace(old, new, 1))
            found = check_overlay(render, copy, overlay, OVERLAYS[overlay], quiet=True)
            if not any(words in p for p in found):
                problems.append(f"self-test: {path} with {new!r} was not caught ({found})")
    print(f"self-test: {len(MUTATIONS)} broken manifests, "
          + ("each caught" if not problems else f"{len(problems)} missed"))
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "..", "deploy", "k8s")
    if shutil.which("kubectl"):
        render = ["kubectl", "kustomize"]
    elif shutil.which("kustomize"):
        render = ["kustomize", "build"]
    else:
        print("SKIPPED: neither kubectl nor kustomize is installed, so the manifests cannot be "
              "rendered. To run this check, install kubectl 1.21 or later (Kubernetes' apt "
              "repository or release binary) or kustomize 4.5 or later. Neither comes from the "
              "registries packd's machines reach: PyPI has no wheel that carries them, and "
              "Debian 12's kubernetes-client (1.20) embeds kustomize 2.0, which cannot read "
              "the overlays.")
        return 77
    present = sorted(os.listdir(os.path.join(root, "overlays")))
    problems = []
    if present != sorted(OVERLAYS):
        problems.append(f"overlays {present}, expected {sorted(OVERLAYS)}")
    for overlay, image in OVERLAYS.items():
        problems += check_overlay(render, root, overlay, image)
    problems += self_test(render, root)
    for p in problems:
        print("FAIL", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
