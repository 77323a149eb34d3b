#!/bin/bash
# A perf profile of vLLM's generate phase on a bench workload (its worker processes, sampled system-wide while
# vllm_runner.py's BATCHGEN_PEER_MARK file says generation runs). Needs perf and the vllm peer venv (setup.sh).
#   bash bench/peers/profile.sh [workload] [out dir]    then: perf report -i OUT/vllm.perf --comm VLLM::Worker
set -euo pipefail
workload=${1:-shared-prefix}
out=${2:-/tmp/batchgen-vllm-profile}
mkdir -p "$out"
rm -f "$out/mark"
export BATCHGEN_PEER_MARK="$out/mark"
batchgen bench "$workload" --systems vllm --no-roofline > "$out/bench.log" 2>&1 &
bench=$!
until grep -q start "$out/mark" 2>/dev/null; do sleep 0.5; kill -0 $bench 2>/dev/null || { cat "$out/bench.log"; exit 1; }; done
perf record -a -g -F 199 -o "$out/vllm.perf" > "$out/perf.log" 2>&1 &
rec=$!
until grep -q end "$out/mark" 2>/dev/null; do sleep 0.5; done
kill -INT $rec; wait $rec || true; wait $bench
perf report -i "$out/vllm.perf" --stdio --no-children --comm VLLM::Worker --sort dso -g none 2>/dev/null | grep % | head -12
