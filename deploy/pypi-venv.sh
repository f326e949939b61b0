#!/usr/bin/env bash
# The PyPI stack (DESIGN §16): a virtual environment of Debian's python3 holding exactly the
# releases pinned in deploy/pypi-constraints.txt (the newest torch, grpcio, protobuf, numpy,
# transformers, verl and trl, with what they need), without the system's packages. make test runs
# every Python test in it as well as on Debian's stack; the benchmarks time torch 2 and verl in it;
# -DPACKD_TORCH=wheel builds against its libtorch.
#
#   deploy/pypi-venv.sh            make it, or reuse the one made before; its path is the last line
#   deploy/pypi-venv.sh --path     print where it is (or would be), and nothing else: no network
#   deploy/pypi-venv.sh --wheels   print the folder of its downloaded wheels (a local index:
#                                  pip install --no-index --find-links FOLDER ...)
#   deploy/pypi-venv.sh --update   resolve the newest release of each chosen package (the
#                                  constraints file's header names them) and rewrite the file's
#                                  pins; review the diff and commit it
#
# The venv is cached outside the checkout, under PACKD_PYPI_CACHE (default
# ${XDG_CACHE_HOME:-$HOME/.cache}/packd), in a folder named by a digest of the constraints file and
# the interpreter, so a second run, a second clone and CI's later phases reuse it and download
# nothing; changing a pin makes a new one (and removes the old, 6 GB each). The wheels stay in
# one folder beside it, so a pin changed downloads only the wheels that changed.
# PACKD_PYTHON picks another interpreter (default /usr/bin/python3).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
constraints=$here/pypi-constraints.txt
python=${PACKD_PYTHON:-/usr/bin/python3}
cache=${PACKD_PYPI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/packd}
wheels=$cache/wheels
# flash-attn ships only sources that compile CUDA when installed, so its pure-Python padding
# helpers (flash_attn/bert_padding.py), which packd.flash_attn stands in for, are taken from its
# pinned source archive into the venv's peers/ folder, for the tests to load by path.
flash_attn_sdist=flash_attn-2.8.3.tar.gz
flash_attn_url=https://files.pythonhosted.org/packages/3b/b2/8d76c41ad7974ee264754709c22963447f7f8134613fd9ce80984ed0dab7/$flash_attn_sdist
flash_attn_sha256=1e71dd64a9e0280e0447b8a0c2541bad4bf6ac65bdeaa2f90e51a9e57de0370d

die() {
  echo "pypi-venv: $*" >&2
  exit 1
}
[[ -x "$python" ]] || die "$python not found (Debian: apt-get install python3 python3-venv)"
pyver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$({
  cat "$constraints"
  echo "$flash_attn_sdist $flash_attn_sha256"
  readlink -f "$python"
  echo "$pyver"
} | sha256sum | cut -c1-12)
venv=$cache/pypi-venv-py$pyver-$key
stamp=$venv/.packd-complete

case "${1:-}" in
  --path)
    echo "$venv"
    exit 0
    ;;
  --wheels)
    echo "$wheels"
    exit 0
    ;;
  --update | "") ;;
  *)
    echo "usage: $0 [--path | --wheels | --update]" >&2
    exit 2
    ;;
esac

mkdir -p "$cache"
# One maker at a time per cache (two builds, or CI's phases, may ask at once).
exec 9>"$cache/.lock"
flock 9

# The chosen packages, newest releases resolved together, written back over the pins.
if [[ "${1:-}" == --update ]]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  "$python" -m venv "$tmp/venv"
  pip=("$tmp/venv/bin/python" -m pip --disable-pip-version-check)
  "${pip[@]}" install -q --upgrade pip
  "${pip[@]}" install torch grpcio protobuf numpy transformers trl peft pytest einops
  # verl without its dependencies (see the constraints file), then what its modules import.
  "${pip[@]}" install --no-deps verl
  "${pip[@]}" install ray omegaconf "tensordict>=0.8.0,<=0.10.0,!=0.9.0"
  "$tmp/venv/bin/python" -c 'import verl.utils.seqlen_balancing, verl.utils.ulysses'
  {
    sed -n '/^#/p; /^#/!q' "$constraints"
    echo
    "${pip[@]}" freeze --all | grep -v -E '^(pip|wheel)=='
  } >"$tmp/constraints.txt"
  mv "$tmp/constraints.txt" "$constraints"
  echo "pypi-venv: $constraints rewritten; review it (git diff) and commit it"
  exit 0
fi

if [[ -f "$stamp" ]]; then
  echo "$venv"
  exit 0
fi

started=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv" || die "could not make a venv with $python (Debian: apt-get install python3-venv)"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
mkdir -p "$wheels"
before=$(du -sm "$wheels" | cut -f1)
echo "pypi-venv: downloading the wheels of $(grep -c '^[A-Za-z]' "$constraints") pinned packages into $wheels" >&2
"${pip[@]}" download --quiet --only-binary=:all: --no-deps -r "$constraints" -d "$wheels" >&2 ||
  die "could not download the pinned wheels (is PyPI reachable, with pip's proxy and CA settings?)"
after=$(du -sm "$wheels" | cut -f1)
downloaded=$((SECONDS - started))
echo "pypi-venv: installing them into $venv" >&2
"${pip[@]}" install --quiet --no-index --find-links "$wheels" --no-deps -r "$constraints" >&2
if [[ ! -f "$wheels/$flash_attn_sdist" ]]; then
  curl -sSfL -o "$wheels/$flash_attn_sdist.part" "$flash_attn_url" ||
    die "could not download $flash_attn_url"
  mv "$wheels/$flash_attn_sdist.part" "$wheels/$flash_attn_sdist"
fi
echo "$flash_attn_sha256  $wheels/$flash_attn_sdist" | sha256sum --check --quiet ||
  die "$wheels/$flash_attn_sdist is not the archive pinned here (sha256 $flash_attn_sha256)"
mkdir -p "$venv/peers/${flash_attn_sdist%.tar.gz}"
tar -xzOf "$wheels/$flash_attn_sdist" "${flash_attn_sdist%.tar.gz}/flash_attn/bert_padding.py" \
  >"$venv/peers/${flash_attn_sdist%.tar.gz}/bert_padding.py"
"$venv/bin/python" -c 'import torch, grpc, google.protobuf, numpy, transformers, trl, einops
import verl.utils.seqlen_balancing, verl.utils.ulysses' >&2 ||
  die "the packages installed but do not import together"
# Old venvs of other pins go: each is about 6 GB.
for old in "$cache"/pypi-venv-*; do
  [[ "$old" == "$venv" || ! -d "$old" ]] || rm -rf "$old"
done
versions=$("$venv/bin/python" -c 'import importlib.metadata as m
print(" ".join(f"{p} {m.version(p)}" for p in ("torch", "grpcio", "protobuf", "numpy",
      "transformers", "verl", "trl")))')
echo "$versions" >"$stamp"
echo "pypi-venv: made in $((SECONDS - started)) s ($((after - before)) MB downloaded in $downloaded s;" \
  "venv $(du -sm "$venv" | cut -f1) MB): $versions" >&2
echo "$venv"
