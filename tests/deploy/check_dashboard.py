"""Checks the Grafana dashboard deploy/grafana/packd.json against a running packd: the JSON loads
as a dashboard (title, uid, a datasource variable, panels with a title, a grid position and
queries), the panels cover what operators watch (calls, errors, latency, bytes, the memory
budget, regions, devices), and every metric a query names is one that packd exports, read from
the /metrics of a packd started here after a few calls (with --log_format=json, whose every
line must parse as one object).

    /usr/bin/python3 tests/deploy/check_dashboard.py deploy/grafana/packd.json \\
        build/bin/packd build/bin/packctl

Exit 0 when the dashboard passes, 1 with the problems listed."""
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request

# PromQL's functions, aggregations and keywords: the identifiers in a query that are not metrics.
PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "offset", "bool", "rate", "irate", "increase", "delta", "idelta",
    "deriv", "histogram_quantile", "abs", "ceil", "floor", "round", "clamp", "clamp_min",
    "clamp_max", "label_replace", "label_join", "label_values", "vector", "scalar", "time",
    "sum_over_time", "avg_over_time", "max_over_time", "min_over_time", "count_over_time",
    "absent", "changes", "resets", "sort", "sort_desc", "inf", "nan",
}
# What the panels must show between them: each of these metrics in some query.
REQUIRED = (
    "packd_requests_total", "packd_request_duration_seconds_bucket", "packd_request_bytes_total",
    "packd_response_bytes_total", "packd_budget_bytes_in_use", "packd_budget_waiting",
    "packd_regions", "packd_device_calls_total", "packd_device_errors_total",
)


def metric_names(expr):
    """The metric names a PromQL query reads."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)          # string literals
    text = re.sub(r"\{[^}]*\}", "", text)                    # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)                   # ranges
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)                        # Grafana variables
    text = re.sub(r"label_values\(([^,()]*),\s*\w+\s*\)", r"\1", text)  # (metric, label)
    names = set()
    for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if word.lower() not in PROMQL_WORDS:
            names.add(word)
    return names


def queries(dashboard):
    """(where, expr) for every panel target and every query variable."""
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            yield f"panel {panel.get('title')!r} {target.get('refId')}", target.get("expr", "")
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var.get("query")
            yield f"variable {var.get('name')}", q.get("query", "") if isinstance(q, dict) else q


def check(dashboard, exported):
    problems = []
    for key in ("title", "uid", "panels", "schemaVersion"):
        if key not in dashboard:
            problems.append(f"the dashboard has no {key}")
    variables = {v.get("name"): v for v in dashboard.get("templating", {}).get("list", [])}
    if variables.get("datasource", {}).get("type") != "datasource":
        problems.append("no datasource variable: importing it would not ask for a Prometheus")
    ids = set()
    for panel in dashboard.get("panels", []):
        where = f"panel {panel.get('title')!r}"
        if not panel.get("title"):
            problems.append(f"panel {panel.get('id')} has no title")
        if panel.get("id") in ids:
            problems.append(f"{where}: id {panel.get('id')} repeats")
        ids.add(panel.get("id"))
        if not {"h", "w", "x", "y"} <= set(panel.get("gridPos", {})):
            problems.append(f"{where}: no grid position")
        targets = panel.get("targets", [])
        if not targets:
            problems.append(f"{where}: no query")
        refs = [t.get("refId") for t in targets]
        if len(set(refs)) != len(refs):
            problems.append(f"{where}: refIds repeat")
    named = set()
    for where, expr in queries(dashboard):
        names = metric_names(expr)
        if not names:
            problems.append(f"{where}: names no metric: {expr!r}")
        for name in sorted(names):
            named.add(name)
            if name not in exported:
                problems.append(f"{where}: {name} is not a metric packd exports ({expr!r})")
    for name in REQUIRED:
        if name not in named:
            problems.append(f"no panel shows {name}")
    return problems


def json_log(path):
    """The records of a packd log written with --log_format=json: every line one JSON object
    with time, level, message and fields (a line that is not raises)."""
    records = []
    with open(path) as f:
        for line in f:
            if not line.endswith("\n"):
                break  # still being written
            record = json.loads(line)
            if set(record) != {"time", "level", "message", "fields"}:
                raise ValueError(f"log record with keys {sorted(record)}: {line!r}")
            records.append(record)
    return records


def exported_metrics(packd, packctl):
    """The metric names a fresh packd's /metrics shows after a Pack, a Plan and an Info."""
    with tempfile.TemporaryDirectory() as tmp:
        socket = f"unix:{tmp}/packd.sock"
        log_path = os.path.join(tmp, "packd.log")
        with open(log_path, "w") as log:
            server = subprocess.Popen(
                [packd, f"--listen={socket}", "--metrics_listen=127.0.0.1:0",
                 "--shared_memory=off", "--threads=1", "--log_format=json"], stdout=log,
                stderr=subprocess.STDOUT)
        try:
            address = None
            for _ in range(200):
                m = re.search(r"metrics on http://([0-9.]+:[0-9]+)/metrics",
                              " ".join(r["message"] for r in json_log(log_path)))
                if m:
                    address = m.group(1)
                    break
                if server.poll() is not None:
                    break
                time.sleep(0.05)
            if address is None:
                raise RuntimeError("packd did not start:\n" + open(log_path).read())
            for command in (["pack", "--shape=4,64,8"], ["plan", "--samples=64"], ["info"]):
                subprocess.run([packctl, f"--address={socket}", *command], check=True,
                               stdout=subprocess.DEVNULL)
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        finally:
            server.terminate()
            server.wait(timeout=30)
        # Start-up to shutdown: every line a JSON record; the start-up line's fields name the
        # addresses.
        records = json_log(log_path)
        if server.returncode != 0 or records[-1]["message"] != "stopped":
            raise RuntimeError(f"packd exited {server.returncode}, its log ending {records[-1:]}")
        started = [r["fields"] for r in records if r["message"].startswith("listening on")]
        if not started or started[0].get("metrics_address") != address or \
                started[0].get("address") != socket or started[0].get("device") != "cpu":
            raise RuntimeError(f"the start-up log line's fields are {started}")
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", line).group(0))
    return names


def self_test(dashboard, exported):
    """The check must catch a query naming a metric packd does not export, a panel without a
    query, and a required metric no panel shows."""
    failures = []
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][0]["targets"][0]["expr"] = "rate(packd_requests_totl[5m])"
    if not any("packd_requests_totl" in p for p in check(broken, exported)):
        failures.append("a misspelt metric passed")
    broken = json.loads(json.dumps(dashboard))
    broken["panels"][1]["targets"] = []
    if not any("no query" in p for p in check(broken, exported)):
        failures.append("a panel without a query passed")
    broken = json.loads(json.dumps(dashboard))
    broken["panels"] = [p for p in broken["panels"]
                        if "packd_device_errors_total" not in json.dumps(p)]
    if not any("packd_device_errors_total" in p for p in check(broken, exported)):
        failures.append("a dashboard without device errors passed")
    if metric_names('histogram_quantile(0.99, sum by (le, method) '
                    '(rate(x_bucket{a="b", c=~"$d"}[$__rate_interval])))') != {"x_bucket"}:
        failures.append("metric_names misreads a histogram query")
    if metric_names("label_values(packd_regions, kind)") != {"packd_regions"}:
        failures.append("metric_names misreads label_values")
    return failures


def main():
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    path, packd, packctl = sys.argv[1:]
    with open(path) as f:
        dashboard = json.load(f)
    exported = exported_metrics(packd, packctl)
    problems = check(dashboard, exported) + [f"self-test: {f}" for f in self_test(dashboard, exported)]
    for p in problems:
        print("FAIL", p)
    if problems:
        return 1
    panels = len(dashboard["panels"])
    targets = sum(len(p["targets"]) for p in dashboard["panels"])
    print(f"ok: {panels} panels, {targets} queries, every metric named among the "
          f"{len([n for n in exported if n.startswith('packd_')])} packd metric names exported")
    return 0


if __name__ == "__main__":
    sys.exit(main())
