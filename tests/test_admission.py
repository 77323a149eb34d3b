"""Machine-wide admission (pipeline.run.admission): one run computes at a time, the others queue FIFO; --no-wait
fails at once; a dead holder or waiter never blocks; two real `batchgen submit` processes queue and give the
outputs of one combined run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.run import admission, history
from pipeline.run.admission import MachineBusy, MachineLock
from tests.test_pipeline import write_job

REPO = Path(__file__).resolve().parents[1]


def _wait_for(cond, timeout=60.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.05)


def test_fifo_queue_and_no_wait(tmp_path):
    first = MachineLock(["a"], tmp_path)
    assert first.acquire() < 1.0
    assert admission.holder(tmp_path).jobs == ("a",) and admission.holder(tmp_path).pid == os.getpid()
    with pytest.raises(MachineBusy, match=r"busy: batchgen run pid \d+ \(a\).*without --no-wait"):
        MachineLock(["x"], tmp_path, wait=False).acquire()
    assert admission.queue(tmp_path) == []                     # the refused run left no ticket

    order, waited = [], {}

    def run(name):
        lock = MachineLock([name], tmp_path, poll_s=0.02)
        waited[name] = lock.acquire(on_wait=lambda holder, ahead: order.append((name, ahead)))
        order.append(name)
        time.sleep(0.1)
        lock.release()

    b = threading.Thread(target=run, args=("b",))
    b.start()
    # b's ticket is visible before b reports that it waits: wait for the report, or c's may come first
    _wait_for(lambda: len(admission.queue(tmp_path)) == 1 and order == [("b", 0)])
    c = threading.Thread(target=run, args=("c",))
    c.start()
    _wait_for(lambda: len(admission.queue(tmp_path)) == 2)
    assert [o.jobs for o in admission.queue(tmp_path)] == [("b",), ("c",)]
    time.sleep(0.2)
    first.release()
    b.join(10)
    c.join(10)
    assert order == [("b", 0), ("c", 1), "b", "c"]             # first come, first served
    assert waited["c"] > waited["b"] > 0.2
    assert admission.holder(tmp_path) is None and admission.queue(tmp_path) == []


def test_dead_holder_and_dead_waiter_never_block(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    d = admission.machine_dir(tmp_path)
    (d / "queue").mkdir(parents=True)
    info = json.dumps({"pid": int(dead), "jobs": ["gone"], "since": time.time()})
    (d / "holder.json").write_text(info)                       # killed while computing: its flock is gone
    (d / "queue" / f"{0:020d}-{dead}.json").write_text(info)   # killed while waiting: ahead of everyone
    assert admission.holder(tmp_path) is None
    lock = MachineLock(["new"], tmp_path, wait=False)
    assert lock.acquire() < 1.0
    assert admission.queue(tmp_path) == [] and admission.holder(tmp_path).jobs == ("new",)
    lock.release()


ENGINE = "engine:\n  dtype: float32\n  block_size: 16\n  max_num_seqs: 4\n  max_num_batched_tokens: 512\n"


@pytest.mark.slow
def test_two_submits_queue_and_match_a_combined_run(tmp_path, make_docs_dataset, tiny_llama_dir):
    """Two `batchgen submit` processes on two jobs sharing a prefix, started while the machine is busy: both
    queue, run one after the other in arrival order, and produce exactly the rows of one combined submit."""
    state = tmp_path / "state"
    data = make_docs_dataset(n=10)
    extra = f"model: {tiny_llama_dir}\n" + ENGINE
    jobs = {n: write_job(tmp_path, n, data, out=tmp_path / f"sep/{n}.parquet", extra=extra) for n in ("a", "b")}
    (tmp_path / "comb").mkdir()
    together = {n: write_job(tmp_path / "comb", n, data, out=tmp_path / f"comb/{n}.parquet", extra=extra)
                for n in ("a", "b")}
    env = {**os.environ, "BATCHGEN_STATE_DIR": str(state), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-c", "from batchgen.cli import main; main()", "submit", "-q"]

    blocker = MachineLock(["test"], state)                     # the machine is busy when both start
    blocker.acquire()
    procs = {}
    for n in ("a", "b"):
        procs[n] = subprocess.Popen([*cmd, str(jobs[n])], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
        _wait_for(lambda n=n: any(q.jobs == (n,) for q in admission.queue(state)), timeout=120)
    other = write_job(tmp_path, "c", data, out=tmp_path / "sep/c.parquet", extra=extra)
    r = subprocess.run([*cmd, "--no-wait", str(other)], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "this machine is busy: batchgen run pid" in r.stdout + r.stderr, r.stderr
    blocker.release()
    outs = {n: p.communicate(timeout=300)[0] for n, p in procs.items()}
    for n, p in procs.items():
        assert p.returncode == 0, outs[n]
        assert "waiting for the machine" in outs[n]
    runs = {r.job: r for r in history.recent_runs(state_dir=state) if r.status == "ok"}
    assert runs["a"].queued_s > 0 and runs["b"].queued_s > runs["a"].queued_s          # FIFO, one at a time
    assert runs["a"].finished_at <= runs["b"].started_at + runs["b"].queued_s + 0.5
    assert runs["a"].engine_s > 0 and runs["b"].engine_s > 0

    r = subprocess.run([*cmd, str(together["a"]), str(together["b"])], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for n in ("a", "b"):
        sep, comb = pq.read_table(tmp_path / f"sep/{n}.parquet"), pq.read_table(tmp_path / f"comb/{n}.parquet")
        assert sep.column("id").to_pylist() == comb.column("id").to_pylist()
        assert sep.column("summary").to_pylist() == comb.column("summary").to_pylist()
        manifest = json.loads((tmp_path / f"sep/{n}.parquet.manifest.json").read_text())["this_run"]
        assert manifest["achieved_hit_rate"] == manifest["predicted_hit_rate"]   # each prefix prefilled once
