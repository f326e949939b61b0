#!/usr/bin/env bash
# Checks a packd image end to end. Starts it on the host network, as Kubernetes runs it (read-only
# root file system, no capabilities, no privilege escalation), then:
#   1. the image's own packctl asks health until SERVING;
#   2. a Pack of 8 MiB of fresh random bytes under a random mask: the packed bytes must equal the
#      masked rows computed here, byte for byte;
#   3. the metrics endpoint counts that Pack;
#   4. docker stop (SIGTERM) while a load runs: packd drains, logs it, and exits 0 in time.
# Also: the image's size (at most 400 MiB for a CPU image), its user (not root), and that no
# library is missing. Needs docker and python3.
#
#   deploy/check-image.sh [IMAGE]       # default packd:latest; MAX_IMAGE_MIB=400 to change the limit
set -euo pipefail
image=${1:-packd:latest}
max_mib=${MAX_IMAGE_MIB:-400}
name=packd-check-$$
dir=$(mktemp -d)
chmod 777 "$dir"  # the container's user writes the packed bytes here
cleanup() {
  docker rm -f "$name" "$name-load" >/dev/null 2>&1 || true
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "check-image: FAIL: $*" >&2
  if docker inspect "$name" >/dev/null 2>&1; then
    docker logs "$name" 2>&1 | sed 's/^/  packd| /' >&2
  fi
  exit 1
}
step() { echo "check-image: $*"; }

read -r port metrics_port < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')

size=$(docker image inspect -f '{{.Size}}' "$image")
user=$(docker image inspect -f '{{.Config.User}}' "$image")
step "$image: $((size / 1048576)) MiB, user $user"
((size <= max_mib * 1048576)) || fail "the image is $((size / 1048576)) MiB, over $max_mib MiB"
[[ -n "$user" && "$user" != root && "$user" != 0* ]] || fail "the image runs as root"

docker run -d --name "$name" --network host --read-only --cap-drop=ALL \
  --security-opt=no-new-privileges -v "$dir:/check" "$image" \
  --listen="127.0.0.1:$port" --metrics_listen="127.0.0.1:$metrics_port" --drain_seconds=20 \
  >/dev/null
packctl() { docker exec "$name" packctl --address="127.0.0.1:$port" "$@"; }

# 1. Health.
for ((i = 0; ; ++i)); do
  if out=$(packctl health 2>&1); then break; fi
  ((i < 60)) || fail "not SERVING after 30 s: $out"
  [[ "$(docker inspect -f '{{.State.Running}}' "$name")" == true ]] || fail "packd exited"
  sleep 0.5
done
step "health: SERVING"

# 2. A Pack, checked against the masked rows computed here.
python3 - "$dir" <<'EOF'
import os, random, sys
B, S, row = 16, 512, 1024  # float32 [16, 512, 256]: 8 MiB
x = os.urandom(B * S * row)
mask = bytes(random.random() < 0.4 for _ in range(B * S))
packed = b"".join(x[i * row:(i + 1) * row] for i in range(B * S) if mask[i])
for name, data in (("x", x), ("mask", mask), ("expected", packed)):
    with open(os.path.join(sys.argv[1], name + ".bin"), "wb") as f:
        f.write(data)
EOF
chmod 644 "$dir"/*.bin
out=$(packctl pack --shape=16,512,256 --dtype=float32 --input=/check/x.bin \
  --mask_file=/check/mask.bin --output=/check/packed.bin 2>&1) || fail "pack: $out"
cmp -s "$dir/packed.bin" "$dir/expected.bin" ||
  fail "the packed bytes differ from the masked rows ($(stat -c %s "$dir/packed.bin") bytes against $(stat -c %s "$dir/expected.bin"))"
step "pack: $(stat -c %s "$dir/expected.bin") packed bytes equal the masked rows"

# 3. Metrics.
metrics() {
  python3 -c "import urllib.request
print(urllib.request.urlopen('http://127.0.0.1:$metrics_port/metrics', timeout=5).read().decode())"
}
packs_ok() { metrics | awk '$1 == "packd_requests_total{code=\"ok\",method=\"Pack\"}" {print $2}'; }
text=$(metrics) || fail "no metrics on 127.0.0.1:$metrics_port"
[[ "$(packs_ok)" -ge 1 ]] ||
  fail "the metrics do not count the Pack: $(grep packd_requests_total <<<"$text")"
step "metrics: $(grep -c '^packd_' <<<"$text") packd_ series, the Pack counted"

# 4. SIGTERM under load: a drain, then exit code 0 within --drain_seconds. The load runs in a
# container of its own, which outlives the server's, and retries as the clients do: the calls in
# flight finish, and it ends only when the server is gone (UNAVAILABLE), never with a call that
# failed otherwise.
docker run --rm --name "$name-load" --network host --entrypoint packctl "$image" \
  --address="127.0.0.1:$port" --attempts=3 bench --duration=60 --concurrency=2 \
  --shape=8,512,256 --dtype=float32 >"$dir/load.log" 2>&1 &
load=$!
for ((i = 0; i < 80 && $(packs_ok) < 10; ++i)); do sleep 0.25; done  # the load is running
start=$(date +%s.%N)
docker stop -t 25 "$name" >/dev/null
seconds=$(python3 -c "print(f'{$(date +%s.%N) - $start:.1f}')")
wait "$load" && fail "the load did not notice the server stop" || true
code=$(docker inspect -f '{{.State.ExitCode}}' "$name")
logs=$(docker logs "$name" 2>&1)
[[ "$code" == 0 ]] || fail "exit code $code after SIGTERM"
grep -q 'received Terminated' <<<"$logs" || fail "no 'received Terminated' in the log"
grep -q 'draining: readiness NOT_SERVING' <<<"$logs" || fail "no drain in the log"
grep -q 'stopped' <<<"$logs" || fail "no 'stopped' in the log"
if grep -q 'drain time is up' <<<"$logs"; then fail "calls in flight did not finish in time"; fi
grep -q 'UNAVAILABLE' "$dir/load.log" || fail "the load ended with: $(cat "$dir/load.log")"
step "docker stop: drained and exited 0 in $seconds s; the load's calls then: $(cat "$dir/load.log")"
echo "check-image: $image passed"
