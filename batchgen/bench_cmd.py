"""``batchgen bench`` (plugged into the ``batchgen`` group by batchgen/cli.py): the engine benchmark.

The one bench CLI; the work happens in ``bench`` (bench/run.py).
"""
from __future__ import annotations

import dataclasses

import click

from bench.systems.registry import BENCH_EXTRA_SYSTEMS as _EXTRA
from bench.systems.registry import BENCH_SYSTEMS as _SYSTEMS
from bench.systems.registry import STRUCTURED_SYSTEMS as _STRUCTURED
from bench.workloads import BENCH_SHAPES as _SHAPES
from engine import DEFAULT_MODEL


def _csv(value: str | None) -> list[str] | None:
    return None if value is None else [x.strip() for x in value.split(",") if x.strip()]


@click.command("bench")
@click.argument("shape", type=click.Choice(_SHAPES), default="shared-prefix")
@click.option("--quick", is_flag=True, help="A small smoke preset (seconds on a tiny model).")
@click.option("--n", type=int, default=None, help="Documents (requests).")
@click.option("--groups", type=int, default=None, help="Distinct shared prefixes (document i -> group i % groups).")
@click.option("--prefix-tokens", type=int, default=None, help="Shared system prompt + reference tokens per group.")
@click.option("--doc-tokens", type=int, default=None, help="Document tokens per request.")
@click.option("--output-tokens", type=int, default=None, help="Output tokens per request (greedy, ignore_eos).")
@click.option("--model", default=DEFAULT_MODEL, show_default=True,
              help="Alias, HF checkpoint dir or .gguf file; or a bench/models name (qwen2.5-0.5b-instruct, "
              "llama-3.2-1b-instruct, ...: made-up weights, load_format dummy).")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32"]), default="auto", show_default=True,
              help="Every system's dtype (auto: the engine's choice for this CPU).")
@click.option("--threads", type=int, default=None, help="Torch threads for every system (default: torch's).")
@click.option("--systems", default=",".join(_SYSTEMS), show_default=True,
              help=f"Comma list of systems to run (also: {', '.join(_EXTRA)}).")
@click.option("--hf-batch-sizes", default=None, help="Comma list for transformers generate (default 4,8,16; quick: 4).")
@click.option("--max-num-seqs", type=int, default=None, help="batchgen engine option.")
@click.option("--max-num-batched-tokens", type=int, default=None, help="batchgen engine option (and hf-cb's budget).")
@click.option("--kv-cache-memory", type=int, default=None, help="batchgen KV pool in bytes.")
@click.option("--no-roofline", is_flag=True, help="Skip calibration and MFU/MBU.")
@click.option("--breakdown", is_flag=True, help="Also time batchgen's kernel families (linears, LM head, attention, "
              "norms) per step kind, with the linears' op rate: where the time went (bench.breakdown).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the prompt text.")
@click.option("--contend", type=click.IntRange(0, 16), default=0, show_default=True,
              help="Run each batchgen system and peer again beside N busy-loop processes (a shared machine) and report "
                   "how many times longer it took than quiet, and whether its tokens changed.")
@click.option("--structured", is_flag=True, help="Also run batchgen and batchgen-default (those selected) with every "
              "request constrained to a JSON schema, at the same output tokens: constrained vs unconstrained "
              "throughput, forced tokens and masks (bench.workloads.STRUCTURED_SCHEMA).")
@click.option("--quality", is_flag=True, help="Instead of a workload: top-1 agreement and KL of bf16 and int8 against "
              "float32, teacher-forced on the sample documents (the int8 quality bar).")
@click.option("--formats", is_flag=True, help="With --quality: also the int8 formats that would drop the matmul's "
              "per-group float work (per-token activations, SmoothQuant, per-row weights), simulated in float32 "
              "(bench.format_study).")
@click.option("--positions", type=int, default=2000, show_default=True, help="--quality: next-token positions.")
@click.option("--size-sweep", is_flag=True, help="Instead of SHAPE: every shape of bench.sweep sized for --model "
              "(shared-prefix with the prefix cache on and off, long-prompt, long-output, decode at 1, 8 and 48 "
              "rows), batchgen's defaults, int8, and vLLM, OpenVINO and llama.cpp at their best in each; a markdown "
              "table of same-run ratios.")
@click.option("--sweep-only", default=None, help="With --size-sweep: a comma list of its shapes' labels to run "
              "(e.g. 'shared-prefix,shared-prefix cache off'; default: all).")
@click.option("--sweep-rounds", type=click.IntRange(1, 9), default=1, show_default=True,
              help="With --size-sweep: at least this many rounds of every shape (each system loaded once, then once "
              "a round, interleaved; each system's median counts, and each peer's ratio round by round is listed): "
              "for a VM whose speed drifts between runs.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Save the results as JSON (written after each system, so a long run keeps partial results).")
def bench_cmd(shape, quick, n, groups, prefix_tokens, doc_tokens, output_tokens, model, dtype, threads, systems,
              hf_batch_sizes, max_num_seqs, max_num_batched_tokens, kv_cache_memory, no_roofline, breakdown, seed,
              contend, structured, quality, formats, positions, size_sweep, sweep_only, sweep_rounds, json_path):
    """Run a workload through batchgen (prefix cache on/off, int8), transformers and llama.cpp in one run; print
    the table. With --quality: how faithful bf16 and int8 are to float32."""
    # NOTE: lazy: the bench modules import torch; the CLI starts (and lists systems and shapes) without it
    from bench.options import options_from
    from bench.run import run_bench
    from bench.systems.peer import PeerMissing
    from bench.table import format_table, save_json

    if formats and not quality:
        raise click.UsageError("--formats is a --quality measurement: add --quality")
    if quality:
        from bench import quality as q
        if threads:
            import torch
            torch.set_num_threads(threads)
        res = q.measure(model, positions=positions, log=click.echo)
        for name in (n for n in res if n.startswith(("int8 (fp32", "int8 (bf16 prompt"))):
            verdict = "meets" if q.meets_bar(res, name) else "FAILS"
            click.echo(f"{name} {verdict} the bar: top-1 >= bf16's and KL <= 2x bf16's")
        if formats:
            from bench import format_study
            bar = 2 * res["bfloat16"]["kl"]
            click.echo(f"int8 formats, simulated (bar: top-1 >= {res['bfloat16']['top1']:.4f}, KL <= {bar:.6f}):")
            res["formats"] = format_study.measure(model, positions=positions, log=click.echo)
            for name, r in res["formats"].items():
                ok = r["top1"] >= res["bfloat16"]["top1"] and r["kl"] <= bar
                click.echo(f"{name} {'meets' if ok else 'FAILS'} the bar")
        if json_path:
            click.echo(f"saved {save_json(res, json_path)}")
        return

    chosen = _csv(systems) or []
    if structured:
        twins = [_STRUCTURED[s] for s in chosen if s in _STRUCTURED and _STRUCTURED[s] not in chosen]
        if not twins and not any(s in _STRUCTURED.values() for s in chosen):
            raise click.UsageError(f"--structured needs {' or '.join(_STRUCTURED)} in --systems")
        chosen += twins
    bad = sorted(set(chosen) - set(_SYSTEMS) - set(_EXTRA))
    if bad:
        raise click.BadParameter(f"unknown {', '.join(bad)}; choose from {', '.join(_SYSTEMS + _EXTRA)}",
                                 param_hint="--systems")
    try:
        sizes = tuple(int(x) for x in _csv(hf_batch_sizes)) if hf_batch_sizes else None
        opts = options_from(shape, quick, n=n, groups=groups, prefix_tokens=prefix_tokens, doc_tokens=doc_tokens,
                            output_tokens=output_tokens, hf_batch_sizes=sizes, model=model, dtype=dtype,
                            threads=threads, systems=tuple(chosen), max_num_seqs=max_num_seqs,
                            max_num_batched_tokens=max_num_batched_tokens, kv_cache_memory=kv_cache_memory,
                            roofline=not no_roofline, breakdown=breakdown, seed=seed, contend=contend)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    progress = (lambda partial: save_json(partial, json_path)) if json_path else None
    if size_sweep:    # --systems, when given, picks among each shape's systems (its batchgen one always runs)
        named = click.get_current_context().get_parameter_source("systems") != click.core.ParameterSource.DEFAULT
        return _size_sweep(opts, progress, _csv(sweep_only), tuple(chosen) if named else None, sweep_rounds)
    try:
        result = run_bench(opts, progress)
    except PeerMissing as e:            # a peer named in --systems that is not set up: before anything ran
        raise click.UsageError(str(e)) from None
    click.echo(format_table(result))
    if json_path:
        click.echo(f"saved {save_json(result, json_path)}")


def _size_sweep(opts, progress, only: list[str] | None, systems: tuple[str, ...] | None = None,
                rounds: int = 1) -> None:
    """``--size-sweep``: bench.sweep on the model, the venv peers that are set up (the others are named as missing;
    llama.cpp always runs, a skipped row when it is not installed); ``systems``: only those of each shape's
    systems (``--systems`` given), beside the shape's batchgen system."""
    from bench.sweep import SWEEP, format_sweep, run_sweep
    from bench.systems.peer import PeerMissing, check_peer
    from bench.systems.registry import PEER_SYSTEMS
    from costmodel.flops import num_params
    from engine.kernels.cpu_features import cpu_description
    from engine.loader import load_model_config, resolve_model

    peers = []
    for name in PEER_SYSTEMS:
        try:
            check_peer(name, opts.model, opts.load_format)
            peers.append(name)
        except PeerMissing as e:
            click.echo(f"not in the sweep: {e}", err=True)
    params = num_params(load_model_config(resolve_model(opts.model, opts.load_format)))
    shapes = tuple(s for s in SWEEP if not only or s.label in only)
    if only and len(shapes) != len(only):
        raise click.BadParameter(f"choose from {', '.join(s.label for s in SWEEP)}", param_hint="--sweep-only")
    shapes = tuple(dataclasses.replace(s, repeats=max(s.repeats, rounds)) for s in shapes)
    rows = run_sweep(opts, params, shapes, peers=tuple(peers), only=systems,
                     on_result=(lambda rows: progress({"sweep": rows})) if progress else None)
    click.echo(format_sweep(opts.model, cpu_description(), rows))


commands = [bench_cmd]
