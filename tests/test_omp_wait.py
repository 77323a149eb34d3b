"""engine.omp_wait: the short OpenMP spin is set where engine/ loads before torch, never over the user's own
setting, recorded in the engine's info, left out of the peers' environment, and changes no token."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import engine.omp_wait as omp_wait
from tests.model_utils import save_tiny, tiny_hf_model

PROBE = ("import json, os, sys\n{first}\nimport engine.omp_wait as w\n"
         "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), w.applied_by, w.describe()]))")


def _run(code: str, env_extra: dict | None = None, drop=("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")) -> list:
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_first_sets_the_short_spin():
    spin, by, line = _run(PROBE.format(first="import engine"))
    assert (spin, by) == (omp_wait.SPIN_COUNT, "batchgen") and "GOMP_SPINCOUNT=1000" in line


def test_the_users_setting_wins():
    spin, by, line = _run(PROBE.format(first="import engine"), {"OMP_WAIT_POLICY": "active"})
    assert (spin, by) == (None, "user") and "OMP_WAIT_POLICY=active (from the environment)" in line
    spin, by, _ = _run(PROBE.format(first="import engine"), {"GOMP_SPINCOUNT": "5"})
    assert (spin, by) == ("5", "user")


def test_torch_first_is_too_late_and_says_so():
    spin, by, line = _run(PROBE.format(first="import torch\nimport engine"))
    assert (spin, by) == (None, "late") and "could not apply" in line


def test_peers_do_not_inherit_our_setting(monkeypatch):
    monkeypatch.setattr(omp_wait, "applied_by", "batchgen")
    env = {"GOMP_SPINCOUNT": omp_wait.SPIN_COUNT, "PATH": "/bin"}
    assert omp_wait.peer_environment(env) == {"PATH": "/bin"}
    monkeypatch.setattr(omp_wait, "applied_by", "user")
    assert omp_wait.peer_environment(env) == env                    # the user's own value goes along


GENERATE = """import json, sys
import engine
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", max_num_seqs=8, speculative_config="off")
prompts = [[1] + [(7 * i + 3 * j) % 200 + 3 for j in range(20 + i)] for i in range(8)]
outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
print(json.dumps([llm.info.omp_wait, [o.token_ids for o in outs]]))
"""


def test_tokens_are_the_same_however_threads_wait(tmp_path):
    save_tiny(tiny_hf_model("llama"), tmp_path / "tiny")
    runs = {}
    for name, extra in (("short spin", {}), ("passive", {"OMP_WAIT_POLICY": "passive"}),
                        ("active", {"OMP_WAIT_POLICY": "active"})):
        env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
        env.update(extra, OMP_NUM_THREADS="2")
        out = subprocess.run([sys.executable, "-c", GENERATE, str(tmp_path / "tiny")], env=env, capture_output=True,
                             text=True, check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
    assert "batchgen's default" in runs["short spin"][0] and "passive" in runs["passive"][0]
    tokens = [r[1] for r in runs.values()]
    assert tokens[0] == tokens[1] == tokens[2] and all(len(t) == 12 for t in tokens[0])
