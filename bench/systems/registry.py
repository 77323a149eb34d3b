"""The bench's systems by name: light (no torch), so the CLI can list and check them before anything loads.

Each name runs in one module: ``batchgen*`` in systems/batchgen.py (``BATCHGEN_VARIANTS`` holds their engine
settings), ``hf-generate`` and ``hf-cb`` in systems/transformers.py, ``llama.cpp`` in systems/llamacpp.py,
``vllm`` and ``openvino`` (peers in their own venvs, ``bash bench/peers/setup.sh NAME``) in systems/peer.py.
"""
from __future__ import annotations

BENCH_SYSTEMS = ("batchgen", "batchgen-nocache", "batchgen-int8", "batchgen-spec", "hf-generate", "hf-cb",
                 "llama.cpp")
# run when named in --systems only
PEER_SYSTEMS = ("vllm", "vllm-nocache", "openvino")   # each in its own venv, run as a subprocess (systems/peer.py)
BENCH_EXTRA_SYSTEMS = ("batchgen-int8-bf16kv", "batchgen-int8-int8kv", "batchgen-default",
                       "batchgen-default-nocache", "batchgen-nondet", "batchgen-default-nondet",
                       "batchgen-structured", "batchgen-default-structured") + PEER_SYSTEMS
SYSTEMS = BENCH_SYSTEMS + BENCH_EXTRA_SYSTEMS     # the default run: BENCH_SYSTEMS
# every request constrained to a JSON schema (bench.workloads.STRUCTURED_SCHEMA); `bench --structured` adds them
STRUCTURED_SYSTEMS = {"batchgen": "batchgen-structured", "batchgen-default": "batchgen-default-structured"}
INT8_SYSTEMS = ("batchgen-int8", "batchgen-int8-bf16kv", "batchgen-int8-int8kv")
