"""Locks (issue 40): a job's lock is an ``flock`` held for the run's life, not a file judged stale by its content, so
a lock file still being written is someone's lock and two processes never both hold it; a lock whose holder is
gone is taken over; ``batchgen calibrate --retune`` holds the machine (pipeline.run.admission) while it measures."""
from __future__ import annotations

import fcntl
import json
import multiprocessing as mp
import os
import time

import pytest

from pipeline.job.state import RunState, job_dir_for
from pipeline.problems import RunError
from pipeline.run import admission
from pipeline.run.admission import MachineBusy, MachineLock

CTX = mp.get_context("spawn")         # a fresh interpreter: nothing of the test process's state is shared


def _hold_empty(path: str, held, release) -> None:
    """Another process between creating its lock file and writing its pid into it: held, still empty."""
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.set()
    release.wait(30)
    os.close(fd)


def test_an_empty_lock_file_held_by_another_process_is_its_lock(tmp_path):
    out = tmp_path / "out.parquet"
    job_dir_for(out).mkdir(parents=True)
    held, release = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_hold_empty, args=(str(job_dir_for(out) / "lock"), held, release))
    p.start()
    try:
        assert held.wait(30)
        with pytest.raises(RunError, match=r"job 'j' is already running \(pid \? on \?"):
            RunState(out, "j").lock()
        assert (job_dir_for(out) / "lock").exists()           # the holder's file is left alone
    finally:
        release.set()
        p.join(30)
    st = RunState(out, "j")                                    # its process ended: the kernel dropped its lock
    st.lock()
    assert json.loads((job_dir_for(out) / "lock").read_text())["pid"] == os.getpid()
    st.unlock()
    assert not (job_dir_for(out) / "lock").exists()


@pytest.mark.parametrize("content", ["", "{not json", json.dumps({"pid": os.getpid(), "host": os.uname().nodename})])
def test_a_lock_file_nobody_holds_is_taken_over(tmp_path, content):
    """Left by a killed run (or an older batchgen): whatever it says, nobody holds it."""
    out = tmp_path / "out.parquet"
    job_dir_for(out).mkdir(parents=True)
    (job_dir_for(out) / "lock").write_text(content)
    st = RunState(out, "j")
    st.lock()
    with pytest.raises(RunError, match=rf"already running \(pid {os.getpid()} on"):
        RunState(out, "j").lock()                              # held now, by this process's first RunState
    st.unlock()


def _contend(out: str, rounds: int, holders, counter_lock, took) -> None:
    for _ in range(rounds):
        st = RunState(out, "j")
        try:
            st.lock()
        except RunError:
            continue
        with counter_lock:
            holders.value += 1
            took.value = max(took.value, holders.value)
        time.sleep(0.002)
        with counter_lock:
            holders.value -= 1
        st.unlock()


def test_processes_contending_for_a_lock_never_both_hold_it(tmp_path):
    holders, most, counter_lock = CTX.Value("i", 0), CTX.Value("i", 0), CTX.Lock()
    procs = [CTX.Process(target=_contend, args=(str(tmp_path / "out.parquet"), 150, holders, counter_lock, most))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert most.value == 1                                     # someone held it, and never two at once


def test_calibrate_retune_holds_the_machine_while_it_measures(monkeypatch):
    from click.testing import CliRunner

    import engine
    from batchgen.report_cmd import calibrate_cmd
    seen = {}

    class Measured:
        def record(self):
            return {"mode": "table", "reason": "faked"}

    def fake_tune_format(config, retune=False):
        seen["holder"] = admission.holder()
        with pytest.raises(MachineBusy):                       # a submit now would queue behind the probe
            MachineLock(["nightly"], wait=False).acquire()
        return Measured()

    monkeypatch.setattr(engine, "tune_format", fake_tune_format, raising=False)
    res = CliRunner().invoke(calibrate_cmd, ["--retune", "--model", "some-model"])
    assert res.exit_code == 0, res.output
    assert seen["holder"].pid == os.getpid() and seen["holder"].jobs == ("calibrate --retune some-model",)
    assert admission.holder() is None                          # released after
