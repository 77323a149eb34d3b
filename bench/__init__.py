"""The benchmark: named workload shapes through batchgen and transformers, side by side in one run.

    batchgen bench shared-prefix --n 48 --groups 4 --prefix-tokens 1500 --doc-tokens 400 \\
        --output-tokens 64 --json bench.json
    batchgen bench --quick --model path/to/hf_dir        # a small smoke run

Every system gets the same token id lists (built from varied English sentences tokenized with the model's
tokenizer, deterministic), decodes greedily and ignores EOS, so all do identical work:

    batchgen          prefix caching on, prompts submitted in planned order (grouped by shared prefix), float
                      weights (``quantization: none``: the float path the int8 systems are compared with; a job's
                      default, ``auto``, is int8 on the CPUs engine.quant.policy names)
    batchgen-nocache  prefix caching off, same order, float weights
    batchgen-int8     prefix caching on, ``quantization: int8`` (engine.quant.int8; KV cache auto: bf16 where
                      engine.quant.policy measured it faster, else the activation dtype)
    batchgen-int8-bf16kv  the same with ``kv_cache_dtype: bfloat16`` (not in the default systems)
    batchgen-int8-int8kv  the same with ``kv_cache_dtype: int8`` (engine.quant.int8_kv; not in the defaults)
    batchgen-spec     prefix caching on, ``speculative_config: auto`` (n-gram drafts where gating says they pay)
    batchgen-default  a job's defaults: ``quantization: auto``, ``speculative_config: auto``, KV cache auto (what a
                      user gets without an engine section; not in the default systems)
    batchgen-structured, batchgen-default-structured  batchgen / batchgen-default with every request constrained
                      to ``workloads.STRUCTURED_SCHEMA`` (a JSON object whose summary string stays open, so the
                      same output tokens): constrained vs unconstrained throughput, forced tokens, masks
                      (``--structured`` adds them to the selected twins; not in the default systems)
    llama.cpp         llama-cpp-python on the same GGUF, when installed (``pip install -e '.[peer]'``):
                      documents in group order, one Llama object keeping its KV between prompts (prefix
                      reuse), swa_full=True (without it Gemma 3's reused prefixes give different tokens),
                      flash_attn=True, n_batch=512; a dummy model's weights written as GGUF (dummy_gguf.py), Q8_0
                      and F16 probed, the faster run; each GGUF first decoded in a child process (a build that
                      crashes is a failed probe, not the end of the bench)
    vllm              vLLM's CPU backend in its own venv (``bash bench/peers/setup.sh vllm``; not in the defaults):
                      bf16 HF copy of the model, prefix caching, all prompts in one generate (systems/peer.py)
    openvino          OpenVINO GenAI in its own venv (``bash bench/peers/setup.sh openvino``; not in the defaults):
                      fp16 and int8 IRs probed, the faster run; ContinuousBatchingPipeline, one prompt per shared
                      prefix first
    hf-generate       transformers ``generate`` on left-padded batches, one row per batch size tried
    hf-cb             transformers continuous batching (``generate_batch``), where it runs

A prompt is ``[BOS] + prefix[group] + document[i]``:

    | BOS | system + reference of group g (prefix_tokens - 1) | document i (doc_tokens) |  -> output_tokens

Numbers are only meaningful as ratios inside one run: this machine's cores (and its AMX unit) are shared,
so absolute speeds drift between runs. The run notes the load average before and after.

MFU counts the model FLOPs each system had to compute (``costmodel.flops``: window-limited attention, LM head
only on sampled rows; padding and masked work are not counted) against the calibrated matmul peak
(``costmodel.calibrate``); decode MBU counts weight + KV bytes of decode steps against calibrated bandwidth.

    workloads.py        the shapes and their prompts (no torch: the CLI lists the shapes from here)
    systems/            one runner per system (batchgen.py, transformers.py, llamacpp.py, peer.py); registry.py
                        names them
    peers/              the peers' setup.sh and the runners that run inside their venvs
    dummy_checkpoint.py, dummy_gguf.py   a dummy model's weights for the peers (safetensors; GGUF for llama.cpp)
    options.py          BenchOptions (one run's settings) and the CLI's values -> options
    result.py           SystemResult: one system's numbers
    run.py              the orchestrator: every selected system on one workload (``run_bench``)
    table.py            agreement, ratios, the printed table, the JSON
    breakdown.py        kernel-family timers (``--breakdown``)
    quality.py          teacher-forced agreement with float32 (``--quality``)
    format_study.py     int8 formats simulated against the quality bar (``--quality --formats``)
    plan_orders.py      planner orders on real jobs (``python -m bench.plan_orders``)
"""
