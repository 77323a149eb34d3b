"""A venv peer kept loaded across a sweep's rounds: its runner started once in held mode (bench/peers/held.py),
then one timed round each time the bench asks, so the rounds of every system interleave within the same minutes
instead of minutes apart behind a peer's reload (vLLM's takes 50-90 s)."""
from __future__ import annotations

import json
import subprocess
import tempfile
import time
from pathlib import Path

from bench.options import BenchOptions, say
from bench.result import SystemResult
from bench.systems import peer
from bench.systems.peer import PEERS, peer_dtype, peer_request, peer_result, start_runner, stop_runner, tail
from bench.workloads import BenchPrompt

# How long a held runner may take to load and warm up, and to run one round, before it counts as failed.
READY_TIMEOUT_S = 1800.0
ROUND_TIMEOUT_S = 3600.0


class HeldPeer:
    """``start()`` loads the peer (its dtype chosen as for a single run) and waits until it is warm; each
    ``run_round()`` is one timed generate of the workload from an empty prefix cache; ``close()`` ends it. A peer
    that fails at any point gives skipped rows saying why, from then on; one whose weights and KV cache would not
    fit in the memory the systems loaded before it leave is not started (8B: ours beside vLLM's bf16)."""

    def __init__(self, name: str, opts: BenchOptions, prompts: list[BenchPrompt], warmup: list[list[int]],
                 threads: int):
        self.name, self.opts, self.prompts, self.warmup, self.threads = name, opts, prompts, warmup, threads
        self.proc: subprocess.Popen | None = None
        self.failed: str | None = None
        self.rounds = 0
        self.dtype, self.probes = None, {}
        self.load_s: float | None = None
        self._tmp = None

    def start(self) -> None:
        chosen = peer_dtype(self.name, self.opts, self.prompts, self.warmup, self.threads)
        if isinstance(chosen, SystemResult):
            self.failed = chosen.skipped
            return
        self.dtype, self.probes = chosen
        if why := peer.too_big(self.opts.model, self.opts.load_format, self.dtype or "", peer.PEER_KV_BYTES):
            self.failed = (f"not held: {why} beside the systems loaded before it (run it alone: batchgen bench "
                           f"SHAPE --systems {self.name})")
            say(self.opts, f"{self.name}: {self.failed}")
            return
        self._tmp = tempfile.TemporaryDirectory(prefix=f"batchgen-{self.name}-")
        request = {**peer_request(self.name, self.opts, self.prompts, self.warmup, self.threads, self.dtype),
                   "held": True}
        say(self.opts, f"{self.name}: loading, held for the rounds" + (f" ({self.dtype})" if self.dtype else ""))
        self.proc, self.res_path, self.log = start_runner(self.name, request, self.threads, "-held", self._tmp.name,
                                                          stdin=subprocess.PIPE)
        ready = self._wait_for(Path(f"{self.res_path}.ready"), READY_TIMEOUT_S)
        if ready is not None:
            self.load_s = ready.get("load_s")
            say(self.opts, f"{self.name}: loaded in {self.load_s or 0:.1f} s")

    def run_round(self, label: str = "") -> SystemResult:
        if self.failed is None:
            try:
                self.proc.stdin.write(b"go\n")
                self.proc.stdin.flush()
            except OSError:              # it is gone: _wait_for says how it ended
                pass
            data = self._wait_for(Path(f"{self.res_path}.{self.rounds}"), ROUND_TIMEOUT_S)
            self.rounds += 1
            if data is not None:
                res = peer_result(self.name, self.prompts, data, self.dtype, self.probes, self.log)
                res.extra["held_round"] = self.rounds - 1
                say(self.opts, f"{self.name}: {res.wall_s:.1f} s" + (f" ({label})" if label else ""))
                return res
        return SystemResult(system=self.name, label=PEERS[self.name].label, skipped=self.failed)

    def _wait_for(self, path: Path, timeout_s: float) -> dict | None:
        """The file the runner writes whole when it is ready or a round is done; None (and ``failed`` set, the
        runner stopped) when it exits or runs out of time first."""
        t = time.monotonic()
        while not path.exists():
            rc = self.proc.poll()
            if rc is not None:
                self.failed = f"failed (exit {rc}, log {self.log}): {tail(self.log)[-300:]}"
                return None
            if time.monotonic() - t > timeout_s:
                stop_runner(self.proc)
                self.failed = f"stopped after {timeout_s:.0f} s waiting for {path.name} (log {self.log})"
                return None
            time.sleep(0.05)
        return json.loads(path.read_text())

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()              # the end of its stdin: the runner returns
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
            stop_runner(self.proc)                   # and whatever it started, were it still there
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
