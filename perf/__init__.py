"""Measurement tools beside the engine and the pipeline (the cost model: costmodel/); none runs in inference.

    bench.py       batchgen vs transformers on synthetic workloads, side by side (``batchgen bench``)
    bench_plan.py  planner orders (planned / input / shuffled) on real jobs
    quality.py     teacher-forced agreement of bf16 / int8 with float32 (``batchgen bench --quality``)
"""

# The bench's systems and workload shapes, here so the CLI can list them without importing torch.
BENCH_SYSTEMS = ("batchgen", "batchgen-nocache", "batchgen-int8", "batchgen-spec", "hf-generate", "hf-cb",
                 "llama.cpp")
# run when named in --systems only
BENCH_EXTRA_SYSTEMS = ("batchgen-int8-bf16kv", "batchgen-int8-int8kv", "batchgen-default")
BENCH_SHAPES = ("shared-prefix", "long-prompt", "short-prompt", "long-output")
