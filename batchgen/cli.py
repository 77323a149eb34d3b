"""The ``batchgen`` command: submit, validate, plan (+ commands other modules plug in).

User mistakes (bad job files, unreadable inputs, a held lock, a full disk) print one clear message and exit
with code 2, never a traceback. An interrupted run (SIGTERM / Ctrl-C) exits 130 and says how to resume.

Plug-ins: a module ``batchgen.<name>`` in ``PLUGINS`` that exists and has a ``commands`` list of click
commands gets them added to the group; nothing here needs editing for that.
"""
from __future__ import annotations

import functools
import importlib
import json
import sys
from pathlib import Path

import click

from engine import BatchgenError
from pipeline.execute.ray.driver import RayOptions, import_ray
from pipeline.run.runner import Interrupted, RunOptions, run_jobs
from pipeline.run.validate import load_valid_jobs, load_valid_jobs_recorded, validate_files

# NOTE: schedule_cmd owns `cron` and `status`, report_cmd owns `report` and `calibrate`; a name registered twice
# is refused with a warning (the first module wins).
PLUGINS = ("schedule_cmd", "report_cmd", "bench_cmd", "serve_cmd")

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def _user_errors(fn):
    """Turn BatchgenError (ours and the engine's) into one message on stderr and exit code 2."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Interrupted as e:
            click.echo(f"batchgen: {e}", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BatchgenError as e:
            n = len(getattr(e, "problems", ()) or ())
            head = f"batchgen: {n} problem{'s' if n != 1 else ''} found:\n" if n else "batchgen: "
            click.echo(head + str(e), err=True)
            sys.exit(EXIT_USER_ERROR)
        except KeyboardInterrupt:
            click.echo("batchgen: interrupted; finished rows are committed. Run the same command again to "
                       "resume.", err=True)
            sys.exit(EXIT_INTERRUPTED)
    return wrapper


@click.group()
@click.version_option(package_name="batchgen", message="batchgen %(version)s")
def main():
    """batchgen: summarize Parquet / datasets documents with an LLM, prefix-aware, resumable."""


job_files = click.argument("job_files", nargs=-1, required=True, type=click.Path(dir_okay=False))


@main.command()
@job_files
def validate(job_files):
    """Check job files without running the model; report every problem with file, key and line."""
    jobs, problems = validate_files(list(job_files))
    if problems:
        click.echo(f"{len(problems)} problem{'s' if len(problems) != 1 else ''} found:", err=True)
        for p in problems:
            click.echo(f"  {p}", err=True)
        sys.exit(EXIT_USER_ERROR)
    for job in jobs:
        click.echo(f"{job.file}: ok ({job.name}: {job.input.path} -> {job.output.path}, model {job.model})")


@main.command()
@job_files
@_user_errors
def plan(job_files):
    """Dry run: documents, prompt tokens, tokens to compute after prefix sharing, predicted hit rate."""
    jobs = load_valid_jobs(list(job_files))
    for report in run_jobs(jobs, dry_run=True):
        p = report.plan
        click.echo(f"model {report.engine_info.name} (block size {p.block_size}):")
        for jr in report.jobs:
            done = f", {jr.reused} already done" if jr.reused else ""
            done += (f", {jr.planned_copies} identical to another row (computed once: "
                     f"{jr.planned_copy_tokens:,} prompt tokens saved)" if jr.planned_copies else "")
            errs = f", {jr.row_errors} bad rows" if jr.row_errors else ""
            alone = (f", predicted engine time {jr.predicted_engine_s:.1f}s"
                     if jr.predicted_engine_s is not None else "")
            click.echo(f"  {jr.job.name}: {jr.num_rows} documents{done}{errs}; {jr.spill_rows} to compute, "
                       f"{jr.planned_prompt_tokens:,} prompt tokens, predicted hit rate "
                       f"{_pct(jr.predicted_cached, jr.planned_prompt_tokens)}{alone}")
        copies = sum(jr.planned_copies for jr in report.jobs)
        same = f" ({copies} identical to another, computed once)" if copies else ""
        click.echo(f"  total: {p.num_requests + copies} documents{same} in {len(p.group_order)} prefix groups, "
                   f"{p.prompt_tokens:,} prompt tokens, {p.tokens_to_compute:,} to compute after sharing, "
                   f"predicted cache hit rate {_pct(p.cached_tokens, p.prompt_tokens)}")
        pr = report.prediction
        if pr is not None:
            click.echo(f"  predicted engine time: {pr.engine_s:.1f}s ({pr.prefill_s:.1f}s in steps with prompt "
                       f"tokens, {pr.decode_s:.1f}s decode-only; {pr.steps} steps; assumes every document "
                       f"generates max_tokens; model load not included) on {report.engine_info.config.device}, "
                       f"{report.engine_info.config.dtype}")


@main.command()
@click.argument("job_files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option("--fail-fast", is_flag=True, help="Stop at the first bad row (rows done so far are kept).")
@click.option("--commit-every", type=float, default=2.0, show_default=True, metavar="SECONDS",
              help="Make finished rows durable at least this often (a crash loses at most this much work).")
@click.option("--order", type=click.Choice(["planned", "input", "shuffled"]), default="planned",
              show_default=True, help="Request order: the prefix-aware plan, or (to measure the planner) rows as "
                                      "given / shuffled, without grouping or pinning.")
@click.option("--no-wait", is_flag=True, help="Fail at once if another batchgen run is computing on this machine "
              "(default: queue behind it, first come first served).")
@click.option("--ray", "ray_address", is_flag=False, flag_value="", default=None, metavar="[ADDRESS]",
              help="Compute on Ray engine replicas: ADDRESS (or $RAY_ADDRESS) of a cluster, else a local Ray "
                   "instance. Needs the ray extra.")
@click.option("--replicas", type=click.IntRange(min=1), default=None,
              help="With --ray: engine replicas (default: 1 locally, one per alive node on a cluster).")
@click.option("--replica-cpus", type=click.FloatRange(min=0, min_open=True), default=None,
              help="With --ray: CPUs reserved per replica (default: all CPUs / replicas locally, 1 on a cluster).")
@click.option("--replica-gpus", type=click.FloatRange(min=0), default=0.0, help="With --ray: GPUs per replica.")
@click.option("--replica-threads", type=click.IntRange(min=1), default=None,
              help="With --ray: torch threads per replica (default: its CPUs).")
@click.option("--ray-runtime-env", default=None, metavar="JSON",
              help='With --ray: a Ray runtime_env for the replicas, e.g. \'{"pip": ["batchgen==0.1"]}\' or '
                   '\'{"working_dir": ".", "env_vars": {"OMP_NUM_THREADS": "16"}}\'.')
@_user_errors
def submit(job_files, quiet, fail_fast, commit_every, order, no_wait, ray_address, replicas, replica_cpus,
           replica_gpus, replica_threads, ray_runtime_env):
    """Run jobs (all jobs on one model share one engine and its prefix cache). Reruns resume.

    One run computes on a machine at a time: a run started while another computes waits for it (see
    `batchgen status`), since two at once slow each other down and share no prefix cache."""
    job_files = list(job_files)
    if ray_address and (ray_address.endswith((".yaml", ".yml")) or Path(ray_address).is_file()):
        job_files.insert(0, ray_address)        # `--ray jobs/a.yaml`: the flag without an address
        ray_address = ""
    if not job_files:
        raise click.UsageError("Missing argument 'JOB_FILES...'.")
    ray_opts = None
    if ray_address is not None:
        import_ray()                            # without Ray: how to get it, exit 2, before any work
        try:
            env = json.loads(ray_runtime_env) if ray_runtime_env else None
        except ValueError as e:
            raise click.BadParameter(f"not JSON ({e})", param_hint="--ray-runtime-env") from None
        if env is not None and not isinstance(env, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--ray-runtime-env")
        ray_opts = RayOptions(address=ray_address or None, replicas=replicas, num_cpus=replica_cpus,
                              num_gpus=replica_gpus, threads=replica_threads, runtime_env=env)
    elif replicas or replica_cpus or replica_gpus or replica_threads or ray_runtime_env:
        raise click.UsageError("--replicas / --replica-cpus / --replica-gpus / --replica-threads / "
                               "--ray-runtime-env need --ray")
    jobs = load_valid_jobs_recorded(job_files)
    opts = RunOptions(quiet=quiet, fail_fast=fail_fast, commit_interval_s=commit_every, order=order,
                      wait_for_machine=not no_wait, ray=ray_opts)
    for report in run_jobs(jobs, options=opts):
        click.echo(report.summary)


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "n/a"


def _load_plugins() -> None:
    for name in PLUGINS:
        modname = f"batchgen.{name}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as e:
            if e.name == modname:
                continue
            click.echo(f"batchgen: warning: cannot load {modname} ({e})", err=True)
            continue
        except Exception as e:   # NOTE: a broken plug-in must not take submit/validate down with it
            click.echo(f"batchgen: warning: cannot load {modname} ({type(e).__name__}: {e})", err=True)
            continue
        for cmd in getattr(mod, "commands", []):
            if cmd.name in main.commands:
                click.echo(f"batchgen: warning: {modname} defines the command {cmd.name!r} again; ignored", err=True)
                continue
            main.add_command(cmd)


_load_plugins()

