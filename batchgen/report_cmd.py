"""``batchgen report`` and ``batchgen calibrate`` (plugged into the ``batchgen`` group by batchgen/cli.py)."""
from __future__ import annotations

import click
from pyarrow.lib import ArrowException

from pipeline.report import analyze, render_report, shape_warnings
from pipeline.run.trace import read_run


@click.command("report")
@click.argument("run_dirs", nargs=-1, required=True, type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="HTML file to write (default: RUN_DIR/report.html).")
@click.option("--prompt-threshold", type=int, default=512, show_default=True,
              help="Prompts with at least this many tokens count as long.")
@click.option("--output-threshold", type=int, default=128, show_default=True,
              help="Outputs with at least this many tokens count as long.")
def report_cmd(run_dirs, output, prompt_threshold, output_threshold):
    """Render a self-contained HTML report of RUN_DIR (or compare two: RUN_DIR_A RUN_DIR_B)."""
    if len(run_dirs) > 2:
        raise click.UsageError("give one run directory, or two to compare")
    try:
        path = render_report(list(run_dirs), output, prompt_threshold, output_threshold)
        sms = [analyze(read_run(d), prompt_threshold, output_threshold) for d in run_dirs]
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.ClickException(f"cannot write the report: {e}") from None
    except (ArrowException, LookupError, TypeError, ValueError, AttributeError, ArithmeticError) as e:
        # NOTE: run.json's fields are checked as read (pipeline.run.trace_meta); this is the rest of a damaged
        # trace (its Parquet files, values inside a field): one message naming the run, never a traceback
        raise click.ClickException(f"{' or '.join(run_dirs)}: the run trace is damaged or not from this batchgen "
                                   f"({type(e).__name__}: {e})") from None
    for d, sm in zip(run_dirs, sms):
        t = sm["totals"]
        click.echo(f"{d}: {t['documents']} documents, {t['prompt_tokens']} prompt tokens "
                   f"({t['cached_tokens']} cached), {t['output_tokens']} output tokens in {t['wall_s']:.2f} s")
        for line in sm["diagnosis"]:
            click.echo(f"  - {line}")
    if len(sms) == 2:
        for w in shape_warnings(*sms):
            click.echo(f"warning: {w}", err=True)
    click.echo(f"report: {path}")


ALL_FORMATS = ("int8", "bfloat16", "float32")       # calibrate --all-formats, in this order


@click.command("calibrate")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto.")
@click.option("--dtype", type=click.Choice(["auto", "bfloat16", "float32", "float16", "int8"]), default="auto",
              show_default=True, help="The engine dtype to measure matmuls at (auto: what the engine would choose; "
              "int8: the int8 peak, the best of our int8 linear and torch._int_mm).")
@click.option("--all-formats", is_flag=True, help="Measure (or --show) every format's peak one after another: "
              "int8 (CPU only), bfloat16 and float32, the peaks bench's 'how close to the limit' lines divide by.")
@click.option("--quick", is_flag=True, help="One matrix shape and a smaller buffer (seconds, less accurate).")
@click.option("--cache-dir", type=click.Path(file_okay=False), default=None,
              help="Where calibrations are cached (default: $BATCHGEN_CACHE_DIR or ~/.cache/batchgen).")
@click.option("--show", is_flag=True, help="Print the cached calibration without measuring.")
@click.option("--retune", is_flag=True, help="Instead: measure again how to run --model here (the auto settings' "
              "decision, engine.tuning: formats and kernels timed, the fastest within the quality bar) and cache it.")
@click.option("--model", default="gemma-3-270m", show_default=True, help="The model --retune measures.")
def calibrate_cmd(device, dtype, all_formats, quick, cache_dir, show, retune, model):
    """Measure this device's matmul FLOP/s and memory bandwidth; cache them for report's roofline."""
    if retune:
        return _retune(model)
    # NOTE: lazy: torch (here, in costmodel.calibrate and behind choose_dtype) only for this command, not at every
    # `batchgen` start
    import torch

    from engine import choose_dtype

    if all_formats and dtype != "auto":
        raise click.UsageError("--all-formats measures int8, bfloat16 and float32; give it without --dtype")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device_type = _device_type(device)
    if not all_formats:
        _calibrate_one(device, choose_dtype(dtype, device_type), quick, cache_dir, show)
        return
    for i, fmt in enumerate(ALL_FORMATS):
        if i:
            click.echo("")
        if fmt == "int8" and device_type != "cpu":
            click.echo(f"dtype:             int8 skipped: it runs on the CPU only, not on {device}")
            continue
        _calibrate_one(device, choose_dtype(fmt, device_type), quick, cache_dir, show)


def _device_type(device: str) -> str:
    """'cpu' or 'cuda' for a --device value; a usage error (exit 2) for anything else or a GPU that is not here."""
    import torch

    try:
        device_type = torch.device(device).type
    except (RuntimeError, ValueError):
        device_type = None
    if device_type not in ("cpu", "cuda"):
        raise click.BadParameter(f"{device!r} is not a device; give cpu, cuda, cuda:N or auto", param_hint="--device")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise click.BadParameter(f"{device!r}: no CUDA device on this machine", param_hint="--device")
    return device_type


def _calibrate_one(device: str, choice, quick: bool, cache_dir, show: bool) -> None:
    """Measure (or, ``show``, load) and print one dtype's calibration."""
    from costmodel.calibrate import cache_path, calibrate, load_calibration

    dtype = choice.dtype
    if choice.slow:
        click.echo(f"warning: {choice.reason}", err=True)
    if show:
        cal = load_calibration(device, dtype, cache_dir)
        if cal is None:
            path = cache_path(device, dtype, cache_dir)
            what = "the calibration cached at" if path.exists() else "no calibration cached at"
            raise click.ClickException(f"{what} {path}{' is unreadable' if path.exists() else ''}; "
                                       "run `batchgen calibrate`")
    else:
        click.echo(f"calibrating {device} at {dtype}{' (quick)' if quick else ''} ...", err=True)
        cal = calibrate(device, dtype, quick=quick, cache_dir=cache_dir)
    unit = "GOP/s" if dtype == "int8" else "GFLOP/s"
    click.echo(f"device:            {cal.device_name} [{cal.device}]")
    click.echo(f"dtype:             {cal.dtype} ({choice.reason})")
    click.echo(f"matmul peak:       {cal.matmul_flops / 1e9:,.1f} {unit}"
               + (f" ({cal.peak_kernel})" if cal.peak_kernel else ""))
    for shape, v in cal.matmul_by_shape.items():
        click.echo(f"  {shape:>16}: {v / 1e9:,.1f} {unit}")
    if len(cal.kernel_flops) > 1:
        for kernel, k in cal.kernel_flops.items():
            small = f", {k['small_m_flops'] / 1e9:,.1f} at M=16" if k.get("small_m_flops") else ""
            click.echo(f"  {kernel:>16}: {k['matmul_flops'] / 1e9:,.1f} {unit}{small}")
    click.echo(f"matmul at M=16:    {cal.small_m_flops / 1e9:,.1f} {unit}" if cal.small_m_flops else
               "matmul at M=16:    n/a")
    click.echo(f"memory bandwidth:  {cal.memory_bandwidth / 1e9:,.1f} GB/s read, "
               f"{cal.copy_bandwidth / 1e9:,.1f} GB/s copy")
    click.echo(f"ridge point:       {cal.ridge_point:,.1f} FLOP/byte")
    click.echo(f"cached at:         {cache_path(device, dtype, cache_dir)}")


def _retune(model: str) -> None:
    """Measure again, holding the machine (pipeline.run.admission) so no run computes beside the probe: its times
    would be skewed, and the run slowed."""
    from engine import EngineConfig, tune_format
    from pipeline.run.admission import MachineLock

    machine = MachineLock([f"calibrate --retune {model}"])

    def waiting(holder, ahead: int) -> None:
        click.echo(f"waiting for the machine: batchgen run {holder.describe() if holder else 'another run'} is "
                   f"computing{f', {ahead} more queued ahead' if ahead else ''}", err=True)

    machine.acquire(on_wait=waiting)
    try:
        click.echo(f"measuring how to run {model} on this machine (about 15 s) ...", err=True)
        rec = tune_format(EngineConfig.from_options(model), retune=True).record()
    finally:
        machine.release()
    if rec.get("mode") != "tuned":
        click.echo(f"not tuned: {rec.get('reason')}")
        return
    choice = rec["choice"]
    kernels = ", ".join(f"{k}={v}" for k, v in choice["kernels"].items()) or "none to choose"
    click.echo(f"chosen:      {choice['quantization']} weights, {choice['dtype']} activations, "
               f"{choice['kv_cache_dtype']} KV cache; kernels: {kernels}")
    click.echo(f"reason:      {rec['reason']}")
    click.echo("candidates (ms per step, the best round; score: their geometric mean, the prefill weighing as much "
               "as all decode rows together):")
    for c in sorted(rec["candidates"], key=lambda c: c["score_ms"] or float("inf")):
        times = "  ".join(f"{s} {t:,.1f}" for s, t in c["times_ms"].items())
        score = f"{c['score_ms']:,.1f}" if c["score_ms"] is not None else "-"
        marks = (" (table)" if c["table"] else "") + (" (dropped)" if c["name"] in rec["pruned"] else "")
        click.echo(f"  {c['name']:<28} score {score:>8}  {times}{marks}")
    for family, k in rec["kernels"].items():
        scores = ", ".join(f"{i} {v:,.1f}" for i, v in k.get("score_ms", {}).items())
        click.echo(f"kernels {family}: {k['chosen']} ({k['why']}{'; est. scores ' + scores if scores else ''})")
    click.echo(f"measured in {rec['elapsed_s']:.1f} s ({rec['rounds']} rounds, stopped by {rec['stopped']}; load "
               f"average {rec['load_average']:.1f} as it started); decision: {rec['path']}")


commands = [report_cmd, calibrate_cmd]
