"""Step 3 on Ray (``batchgen submit --ray``): engine replicas as Ray actors, fed whole prefix groups by this driver.

    driver (this process)                          actors (pipeline/execute/ray/replica.py, one engine.LLM each)
      prepare + plan, as a local run                  work(units, max_s) -> finished outputs + steps
      pipeline.execute.ray.assign: units -> replicas  ──►     ...
      results -> Runner (commit, trace, bar)  ◄──

``RayExecution`` is an ``execute.Execution``: the runner's one loop drives it as it drives a local engine.

Only the driver commits (the same part-file protocol as a local run), so a dead actor costs at most its
unfinished requests: they go back to the queue (``Assigner.lost``) and a replacement actor is started, up to
``max_restarts`` in all; a unit that was in flight at ``max_tries`` deaths is given up and its rows get an
error. The driver dying is a crash like any other: the next run resumes from the committed parts.

Why not Ray Data's LLM processor: it routes batches by locality and load, not content, so rows that share a
prefix scatter over replicas and every replica recomputes it; and its checkpointing does not cover this
exactly-once protocol.
"""
from __future__ import annotations

import dataclasses
import itertools
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from engine import EngineConfig, EngineInfo, RequestMetrics, RequestOutput, StepStats
from pipeline.execute.ray.assign import Assigner, make_units
from pipeline.execute.ray.replica import Replica
from pipeline.plan.batch import Batch
from pipeline.problems import RunError

RAY_HINT = "pip install -e '.[ray]'  (Ray 2.60, an optional extra)"


class RayMissing(RunError):
    """``--ray`` without Ray installed (the CLI exits 2)."""


@dataclass
class RayOptions:
    address: str | None = None        # None: $RAY_ADDRESS, else a local instance; "local": always local
    replicas: int | None = None       # None: local -> 1; a cluster -> one per alive node
    num_cpus: float | None = None     # per replica; None: local -> the machine's CPUs / replicas; cluster -> 1
    num_gpus: float = 0.0             # per replica
    threads: int | None = None        # torch threads per replica; None: its CPU share (at least 1)
    max_restarts: int | None = None   # replacement actors in all; None: 2 x replicas + what isolating a killer takes
    max_tries: int = 3                # a unit in flight at this many replica deaths is given up
    object_store_mb: int = 256        # local instance only: results are small, the store need not be big
    call_s: float = 0.5               # a replica returns finished rows at least this often
    runtime_env: dict | None = None   # the replicas' Ray runtime_env (e.g. {"env_vars": {...}}, {"pip": [...]})


def import_ray():
    # NOTE: imported here, not at module level: Ray is an optional extra and slow to import.
    try:
        import ray
    except ImportError:
        raise RayMissing(f"--ray needs Ray, which is not installed: {RAY_HINT}") from None
    return ray


@dataclass
class ReplicaStats:
    replica: int
    incarnation: int
    host: str = ""
    node: str = ""                    # Ray node id
    pid: int = 0
    load_s: float | None = None
    threads: int = 0
    dtype: str = ""
    cpu_kernels: str = ""
    rows: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    step_s: float = 0.0
    groups: set = field(default_factory=set)
    died: str | None = None

    def to_dict(self) -> dict:
        computed = self.prompt_tokens - self.cached_tokens
        return {"replica": self.replica, "incarnation": self.incarnation, "host": self.host, "node": self.node,
                "pid": self.pid,
                "load_s": None if self.load_s is None else round(self.load_s, 3), "threads": self.threads,
                "dtype": self.dtype, "cpu_kernels": self.cpu_kernels, "rows": self.rows,
                "groups": len(self.groups), "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "output_tokens": self.output_tokens,
                "hit_rate": round(self.cached_tokens / self.prompt_tokens, 4) if self.prompt_tokens else None,
                "steps": self.steps, "step_s": round(self.step_s, 3),
                "tokens_per_s": round((computed + self.output_tokens) / self.step_s, 1) if self.step_s else None,
                "died": self.died}


@dataclass
class _Slot:
    index: int
    incarnation: int
    actor: object
    stats: ReplicaStats
    ready: bool = False
    busy: object = None               # the ObjectRef of the call in flight


class RayExecution:
    """Start the replicas, feed them each batch's units, yield every finished output (``execute.Execution``)."""

    def __init__(self, opts: RayOptions, config: EngineConfig, info: EngineInfo,
                 echo: Callable[[str], None] = print):
        self.opts, self.config, self.info, self.echo = opts, config, info, echo
        self.run = next(_RUNS)        # names this execution's replicas apart from an earlier one's, still releasing
        self.ray = import_ray()
        self.started_ray = False
        self.replicas = self.num_cpus = self.threads = 0
        self.history: list[ReplicaStats] = []
        self.assigner: Assigner | None = None
        self.restarts = 0
        self.address = ""
        self.loaded = self.failed_loads = 0
        self.first_info: EngineInfo | None = None      # the first replica's (the manifest's model section)
        self.slots: list[_Slot] = []
        self.first_assigner: Assigner | None = None    # the main plan's (the manifest's prefix prefills)
        self.plans = 0                                 # plans run (1 + reduce levels with map_reduce)
        self.batch: Batch | None = None
        self._steps: list[tuple[list[StepStats], int]] = []

    # ---- Ray itself ----
    def start(self) -> None:
        ray, o = self.ray, self.opts
        address = o.address if o.address is not None else os.environ.get("RAY_ADDRESS") or "local"
        if ray.is_initialized():
            self.address = "already initialized"
        elif address == "local":
            cpus = os.cpu_count() or 1
            self.replicas = o.replicas or 1
            self.num_cpus = o.num_cpus or max(1, cpus // self.replicas)
            ray.init(address="local", num_cpus=max(cpus, int(np.ceil(self.num_cpus * self.replicas))),
                     num_gpus=int(np.ceil(o.num_gpus * self.replicas)) if o.num_gpus else None,
                     include_dashboard=False, object_store_memory=o.object_store_mb * 2**20,
                     logging_level="WARNING")
            self.started_ray, self.address = True, "local"
        else:
            ray.init(address=address, logging_level="WARNING")
            self.address = address
        if not self.replicas:
            alive = [n for n in ray.nodes() if n.get("Alive")]
            self.replicas = o.replicas or max(1, len(alive))
            self.num_cpus = o.num_cpus or 1
        self.threads = o.threads or max(1, int(self.num_cpus))
        # enough for every replica to die twice, plus isolating one killer request (halving, then its tries)
        self.max_restarts = o.max_restarts if o.max_restarts is not None else \
            2 * self.replicas + self.info.config.max_num_seqs.bit_length() + o.max_tries

    def close(self) -> None:
        """Stop the actors (and the local Ray instance this started); safe to call twice."""
        slots, self.slots = self.slots, []
        for s in slots:
            try:
                self.ray.kill(s.actor)
            except Exception:       # NOTE: already dead, or Ray is going down: nothing to stop
                pass
        if self.started_ray:
            self.started_ray = False
            self.ray.shutdown()

    def _start_actor(self, index: int, incarnation: int) -> _Slot:
        cls = self.ray.remote(Replica)
        # NOTE: named (this driver's pid and execution, replica, incarnation) so an operator or a test can find one
        # to kill; a killed actor's name is released asynchronously, so a name is never used twice.
        # NOTE: the runtime_env goes on the actors, so it applies on a Ray instance someone else started too.
        extra = {"runtime_env": self.opts.runtime_env} if self.opts.runtime_env else {}
        actor = cls.options(num_cpus=self.num_cpus, num_gpus=self.opts.num_gpus or 0, max_restarts=0,
                            max_task_retries=0, name=replica_name(index, incarnation, self.run), **extra)
        actor = actor.remote(index, incarnation, self.config, self.threads,
                             os.environ.get("BATCHGEN_RAY_FAULT", ""), os.environ.get("BATCHGEN_RAY_ENGINE", ""))
        slot = _Slot(index, incarnation, actor, ReplicaStats(index, incarnation))
        slot.busy = actor.hello.remote()
        self.history.append(slot.stats)
        return slot

    # ---- execute.Execution ----
    def begin(self, batch: Batch) -> None:
        """Cut the batch into units (``ray.assign``). The replicas stay up for the next batch; ``close`` stops
        them."""
        heads, bs = batch.heads, batch.plan.block_size

        def shared(a: int, b: int) -> int:             # prefix tokens two groups' heads share, in full blocks
            ha, hb = heads[a], heads[b]
            n = min(len(ha), len(hb))
            i = next((i for i in range(n) if ha[i] != hb[i]), n)
            return i // bs * bs
        self.batch = batch
        asg = self.assigner = Assigner(make_units(batch.plan, batch.max_tokens(), self.info.config.max_num_seqs),
                                       self.replicas, self.opts.max_tries, shared=shared)
        self.first_assigner = self.first_assigner or asg
        # NOTE: the replicas outlive one plan (map_reduce runs a plan per reduce level): loaded once, caches kept.
        if not self.slots:
            self.slots = [self._start_actor(r, 0) for r in range(self.replicas)]
        self.plans += 1

    @property
    def done(self) -> bool:
        return self.assigner.done

    def poll(self) -> Iterator[tuple[int, RequestOutput]]:
        """Hand idle replicas their next units, wait (at most a second) for one call to return, yield what it
        finished (or, when its replica died, the rows given up)."""
        try:
            yield from self._poll()
        except BaseException:
            self.close()
            raise

    def steps(self) -> list[tuple[list[StepStats], int]]:
        out, self._steps = self._steps, []
        return out

    def engine_info(self) -> EngineInfo:
        return self.first_info or self.info

    def _poll(self) -> Iterator[tuple[int, RequestOutput]]:
        ray, asg, batch, slots = self.ray, self.assigner, self.batch, self.slots
        window = max(1, 3 * self.info.config.max_num_seqs)
        for s in slots:
            if s.ready and s.busy is None and s.index not in asg.retired:
                units = asg.take(s.index, window - asg.rows_in_flight(s.index))
                if units or asg.in_flight[s.index]:
                    payload = [(u.uid, list(batch.heads[u.group]), [(p, *batch.prompt(p)) for p in u.positions])
                               for u in units]
                    for u in units:
                        s.stats.groups.add(u.group)
                    s.busy = s.actor.work.remote(payload, self.opts.call_s)
        calls = {s.busy: s for s in slots if s.busy is not None}
        if not calls:
            if asg.done:
                return
            raise RunError("internal error: work is left but no replica has any; run again to resume")
        done, _ = ray.wait(list(calls), num_returns=1, timeout=1.0)
        for ref in done:
            s = calls[ref]
            s.busy = None
            try:
                res = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.ObjectLostError) as e:
                yield from self._lost(slots.index(s), e)
                continue
            if not s.ready:
                self._hello(s, res)
                continue
            # this clock minus the replica's: monotonic clocks are per machine
            delta = 0.0 if s.stats.host == socket.gethostname() else time.monotonic() - res["now"]
            for out in res["outputs"]:
                out = _shifted(out, delta)
                p = int(out.request_id)
                asg.finished(s.index, p)
                st = s.stats
                st.rows += 1
                st.prompt_tokens += len(out.prompt_token_ids)
                st.cached_tokens += int(out.num_cached_tokens or 0)
                st.output_tokens += len(out.token_ids)
                yield p, out
            steps = [dataclasses.replace(x, start_time=x.start_time + delta, end_time=x.end_time + delta)
                     for x in res["steps"]]
            s.stats.steps += len(steps)
            s.stats.step_s += sum(x.end_time - x.start_time for x in steps)
            self._steps.append((steps, s.index * 1000 + s.incarnation))

    def _hello(self, s: _Slot, res: dict) -> None:
        s.ready = True
        info: EngineInfo = res["info"]
        self.loaded += 1
        self.first_info = self.first_info or info
        st = s.stats
        st.host, st.node, st.pid = res["host"], res["node"], res["pid"]
        st.load_s, st.threads = res["load_s"], res["threads"]
        st.dtype, st.cpu_kernels = info.config.dtype, info.cpu_kernels
        self.echo(f"replica {s.index}{f'.{s.incarnation}' if s.incarnation else ''}: {st.host} pid {st.pid}, "
                  f"{st.threads} thread(s), {info.config.dtype}, loaded in {st.load_s:.1f}s")

    def _lost(self, i: int, err: Exception) -> Iterator[tuple[int, RequestOutput]]:
        """Replica slot ``i`` died: requeue its unfinished units (or give them up: their error outputs are yielded)
        and start a replacement if allowed."""
        asg, s = self.assigner, self.slots[i]
        why = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        s.stats.died = why
        if not s.ready:
            self.failed_loads += 1
            # NOTE: when no replica has ever loaded, one that cannot (bad model, too little memory) would fail
            # the same way on every restart: say why at once instead of restarting.
            if not self.loaded and self.failed_loads >= self.replicas:
                raise RunError(f"no Ray replica could start the engine: {err}")
        retire = self.restarts >= self.max_restarts
        rows = asg.rows_in_flight(s.index)
        for u in asg.lost(s.index, retire):
            msg = (f"gave up after its Ray replica died {u.tries} times while computing it (prefix group "
                   f"{u.group}); last: {why}")
            for p in u.positions:
                yield p, error_output(p, msg)
        tail = "no replacement (restart limit reached)" if retire else \
            f"starting a replacement ({self.restarts + 1} of at most {self.max_restarts})"
        self.echo(f"replica {s.index} died ({why}); {rows} unfinished rows go back to the queue; {tail}")
        if retire:
            if len(asg.retired) == self.replicas and not asg.done:
                raise RunError(f"every Ray replica died and the restart limit ({self.max_restarts}) is reached; "
                               f"last: {why}. Committed rows are kept; run again to resume.")
            return
        self.restarts += 1
        self.slots[i] = self._start_actor(s.index, s.incarnation + 1)

    def summary(self) -> dict:
        """The manifest's ``this_run.distributed`` (prefix prefills: of the main plan, not the reduce levels)."""
        asg = self.first_assigner
        prefills = asg.prefills() if asg else {}
        return {"address": self.address, "replicas": self.replicas, "num_cpus_per_replica": self.num_cpus,
                "threads_per_replica": self.threads, "restarts": self.restarts, "plans": self.plans,
                "stolen_units": asg.stolen if asg else 0,
                "split_groups": sorted(asg.split) if asg else [],
                "prefix_prefills": {str(g): n for g, n in prefills.items()},
                "groups_on_more_than_one_replica": sum(1 for n in prefills.values() if n > 1),
                "per_replica": [h.to_dict() for h in self.history]}


_RUNS = itertools.count()


def replica_name(index: int, incarnation: int, run: int) -> str:
    """``batchgen-<driver pid>-<execution>-replica-<index>.<incarnation>``."""
    return f"batchgen-{os.getpid()}-{run}-replica-{index}.{incarnation}"


def error_output(position: int, message: str) -> RequestOutput:
    return RequestOutput(str(position), None, [], "", [], "error", 0, RequestMetrics(arrival_time=time.monotonic()),
                         error=message)


def _shifted(out: RequestOutput, delta: float) -> RequestOutput:
    """The output with its replica-clock timestamps moved onto this process's clock."""
    if not delta:
        return out
    m = out.metrics

    def sh(t):
        return None if t is None else t + delta
    m2 = dataclasses.replace(m, arrival_time=m.arrival_time + delta, first_scheduled_time=sh(m.first_scheduled_time),
                             prefill_start_time=sh(m.prefill_start_time), prefill_end_time=sh(m.prefill_end_time),
                             first_token_time=sh(m.first_token_time), finish_time=sh(m.finish_time),
                             token_times=[t + delta for t in m.token_times])
    return dataclasses.replace(out, metrics=m2)


__all__ = ["RayOptions", "RayExecution", "RayMissing", "import_ray", "error_output", "replica_name"]
