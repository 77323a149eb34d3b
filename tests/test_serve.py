"""`batchgen serve`: OpenAI's Batch API driven by the official `openai` client against a real server process (the
tiny chat Llama): a batch's output and error files equal a direct `batchgen submit` of the same file row for row;
cancel mid-run keeps the finished lines; expiry; a SIGKILLed server restarted finishes every line exactly once;
bad files and keys get OpenAI's error shapes."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.io.openai_batch import read_output
from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs
from tests.test_openai_batch import ENGINE, chat_model, req, sys_user, write_job

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

REPO = Path(__file__).resolve().parents[1]
KEYS = ("sk-test-alice", "sk-test-bob")
TICKETS = ["My charger stopped working after a week.", "The screen arrived cracked, I want a replacement.",
           "Where is my invoice for March?", "The battery drains overnight.", "Please cancel my subscription.",
           "I was charged twice for one order.", "The manual is missing from the box.", "Can I upgrade my plan?"]


def without_model(line: str) -> str:
    d = json.loads(line)
    del d["body"]["model"]
    return json.dumps(d)


def lines_for(n: int, model="tiny") -> list[str]:
    return [req(f"q{i}", sys_user(TICKETS[i % len(TICKETS)] + f" (ticket {i})"), model=model) for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tmp_path: Path, model: str, env: dict | None = None):
        self.dir, self.port = tmp_path / "serve-data", _free_port()
        (tmp_path / "keys").write_text("\n".join(KEYS) + "\n")
        engine = yaml.safe_load(ENGINE)["engine"]
        (tmp_path / "serve.yaml").write_text(json.dumps({
            "models": {"tiny": {"model": model, "engine": engine}}, "generation": {"max_tokens": 8, "temperature": 0},
            "commit_every_s": 0}))
        self.cmd = [sys.executable, "-m", "batchgen", "serve", "--port", str(self.port), "--api-key-file",
                    str(tmp_path / "keys"), "--config", str(tmp_path / "serve.yaml"), "--data-dir", str(self.dir)]
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.log = tmp_path / "server.log"
        self.proc = None

    def start(self):
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                time.sleep(0.2)
        raise AssertionError("server did not start: " + self.log.read_text())

    def client(self, key=KEYS[0]):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=key, max_retries=0)

    def kill(self):
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def server_for(tmp_path, chat_model):
    started = []

    def make(env=None):
        s = Server(tmp_path, chat_model, env).start()
        started.append(s)
        return s
    yield make
    for s in started:
        s.stop()


def upload(client, tmp_path, lines, name="in.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    with open(p, "rb") as fh:
        return client.files.create(file=fh, purpose="batch")


def wait_for(client, batch_id, done=("completed", "failed", "expired", "cancelled"), timeout=180, until=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in done or (until is not None and until(b)):
            return b
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {b.status}")


def jsonl(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def direct(tmp_path, model, lines) -> dict[str, dict]:
    """`batchgen submit` of the same lines (in process), by custom_id."""
    job, out = write_job(tmp_path, model, name="direct", lines=lines)
    run_jobs([load_job(job)], options=RunOptions(quiet=True))
    return {x["custom_id"]: x for x in read_output(out)}


def same(a: dict, b: dict) -> bool:
    """Two output lines carry the same result (ids, clocks and prefix-cache hits aside: a resumed run's cache
    starts cold)."""
    if a["error"] or b["error"]:
        return bool(a["error"]) == bool(b["error"])
    ra, rb = a["response"]["body"], b["response"]["body"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    return ra["choices"] == rb["choices"] and all(ra["usage"][k] == rb["usage"][k] for k in counts)


def test_a_batch_equals_a_direct_submit_row_for_row(server_for, tmp_path, chat_model):
    lines = lines_for(6) + [req("bad-field", sys_user("hi"), model="tiny", tools=[{"type": "function"}]),
                            without_model(req("no-model", sys_user("Refund please."))),
                            req("other-model", sys_user("hi"), model="gpt-4o")]
    s = server_for()
    c = s.client()
    f = upload(c, tmp_path, lines)
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len("\n".join(lines)) + 1
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                         metadata={"team": "support"})
    assert b.status == "validating" and b.metadata == {"team": "support"}
    b = wait_for(c, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (9, 7, 2)
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    out, err = jsonl(c, b.output_file_id), jsonl(c, b.error_file_id)
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(6)] + ["no-model"]
    assert [x["custom_id"] for x in err] == ["bad-field", "other-model"]
    assert err[1]["error"]["code"] == "model_not_found" and "gpt-4o" in err[1]["error"]["message"]
    ref = direct(tmp_path, chat_model, lines[:8])
    for x in out + err[:1]:
        assert same(x, ref[x["custom_id"]]), x["custom_id"]
    # the batch's run is a run like any other: in the history `batchgen status` shows
    from pipeline.run.history import recent_runs
    [run] = recent_runs(f"{b.id}-0")
    assert run.status == "ok" and run.rows_done + run.rows_failed == 8
    assert [x.id for x in c.batches.list(limit=5).data] == [b.id]
    # pagination: newest first, `after` the last id of a page
    b2 = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    page = c.batches.list(limit=1)
    assert [x.id for x in page.data] == [b2.id] and page.has_more
    assert [x.id for x in c.batches.list(limit=1, after=b2.id).data] == [b.id]
    assert c.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def test_keys_bad_files_and_limits(server_for, tmp_path):
    s = server_for()
    alice, bob = s.client(KEYS[0]), s.client(KEYS[1])
    f = upload(alice, tmp_path, lines_for(2))
    with pytest.raises(openai.AuthenticationError):
        s.client("sk-wrong").files.retrieve(f.id)
    import httpx
    r = httpx.get(f"http://127.0.0.1:{s.port}/v1/files/{f.id}")          # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError):                 # another key cannot see it
        bob.files.content(f.id)
    with pytest.raises(openai.BadRequestError):
        bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve("../serve.db")
    with pytest.raises(openai.BadRequestError) as e:
        alice.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    with pytest.raises(openai.BadRequestError):
        upload(alice, tmp_path, ["{}"] * 50_002, "big.jsonl")
    # files that fail validation: the batch fails with OpenAI's errors (code, line)
    cases = {"invalid_json_line": ["{not json"] + lines_for(1),
             "duplicate_custom_id": lines_for(2) + [lines_for(1)[0]],
             "mismatched_endpoint": [req("x", sys_user("hi"), url="/v1/completions")]}
    for code, lines in cases.items():
        fb = upload(alice, tmp_path, lines, f"{code}.jsonl")
        b = wait_for(alice, alice.batches.create(input_file_id=fb.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
        assert b.status == "failed" and b.failed_at and b.errors.data[0].code == code, (code, b)
        assert b.errors.data[0].line == (3 if code == "duplicate_custom_id" else 1)


def test_completions_endpoint_gives_text_completions(server_for, tmp_path, chat_model):
    """/v1/completions: the prompt as it is (no chat template), a text_completion back, as a direct submit."""
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"model": "tiny", "prompt": f"Summary of ticket {i}: " + TICKETS[i], "max_tokens": 5}})
             for i in range(3)]
    lines.append(json.dumps({"custom_id": "bad", "method": "POST", "url": "/v1/completions",
                             "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}))
    c = server_for().client()
    f = upload(c, tmp_path, lines)
    b = wait_for(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (3, 1)
    out, err = jsonl(c, b.output_file_id), jsonl(c, b.error_file_id)
    ref = direct(tmp_path, chat_model, lines)
    for x in out:
        body = x["response"]["body"]
        assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
        assert body["choices"] == ref[x["custom_id"]]["response"]["body"]["choices"]
        assert set(body["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}
        assert body["usage"]["completion_tokens"] == 5
    assert err[0]["custom_id"] == "bad" and "body.messages" in err[0]["error"]["message"]


def slow_batch(server_for, tmp_path, committed: int):
    """A server whose engine steps are slowed, and a 24-line batch on it with ``committed`` lines done."""
    s = server_for({"BATCHGEN_FAULT": "step-delay:0.1"})
    c = s.client()
    lines = lines_for(24)
    b = c.batches.create(input_file_id=upload(c, tmp_path, lines).id, endpoint="/v1/chat/completions",
                         completion_window="24h")
    wait_for(c, b.id, until=lambda x: x.request_counts.completed >= committed)
    return s, c, lines, b


def test_cancel_mid_run_keeps_the_finished_lines(server_for, tmp_path, chat_model):
    s, c, lines, b = slow_batch(server_for, tmp_path, committed=1)
    # a batch created while another computes is validated at once, and runs next
    later = c.batches.create(input_file_id=upload(c, tmp_path, lines_for(2), "later.jsonl").id,
                             endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_for(c, later.id, done=("in_progress",), timeout=30).request_counts.total == 2
    assert c.batches.retrieve(b.id).status == "in_progress"
    assert c.batches.cancel(b.id).status in ("cancelling", "cancelled")
    assert wait_for(c, later.id).status == "completed"
    b = wait_for(c, b.id)
    assert b.status == "cancelled" and b.cancelled_at and b.cancelling_at
    out = jsonl(c, b.output_file_id)
    assert 1 <= len(out) < 24 and b.request_counts.completed == len(out)
    ref = direct(tmp_path, chat_model, lines)
    assert all(same(x, ref[x["custom_id"]]) for x in out)
    with pytest.raises(openai.NotFoundError):
        c.batches.cancel("batch_" + "0" * 24)


def test_expired_batch_returns_what_finished(server_for, tmp_path):
    s = server_for({"BATCHGEN_FAULT": "step-delay:0.1", "BATCHGEN_SERVE_WINDOW_S": "6"})
    c = s.client()
    f = upload(c, tmp_path, lines_for(40))
    b = wait_for(c, c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                     completion_window="24h").id)
    assert b.status == "expired" and b.expired_at and b.expires_at - b.created_at == 6
    assert b.request_counts.completed == len(jsonl(c, b.output_file_id)) < 40


def test_a_sigkilled_server_restarted_finishes_every_line_once(server_for, tmp_path, chat_model):
    s, c, lines, b = slow_batch(server_for, tmp_path, committed=2)
    s.kill()                                          # the server and (PR_SET_PDEATHSIG) its run
    s.env.pop("BATCHGEN_FAULT")
    s.start()
    b = wait_for(c, b.id)
    assert b.status == "completed"
    out = jsonl(c, b.output_file_id)
    assert [x["custom_id"] for x in out] == [f"q{i}" for i in range(24)]
    ref = direct(tmp_path, chat_model, lines)
    assert all(same(x, ref[x["custom_id"]]) for x in out)
    runs = (s.dir / "runs.log").read_text()
    assert runs.count("\n== ") == 2                       # the restart ran the batch's jobs again, and resumed


def test_serve_refuses_no_auth_off_loopback_and_no_key():
    from click.testing import CliRunner

    from batchgen.cli import main
    r = CliRunner().invoke(main, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert r.exit_code == 2 and "loopback" in r.output
    r = CliRunner().invoke(main, ["serve"])
    assert r.exit_code == 2 and "--api-key-file" in r.output


def test_serve_with_ray_runs_each_batch_as_a_submit_on_ray_replicas():
    """``batchgen serve --ray [ADDRESS] --replicas N``: every batch run is ``batchgen submit --ray`` with them, as
    the real ``submit`` command parses it; --replicas alone is refused."""
    from click.testing import CliRunner

    from batchgen.cli import main
    from pipeline.serve.worker import ServeConfig
    submit = main.commands["submit"]
    for cfg, address in ((ServeConfig(ray_address="", replicas=2), ""),
                         (ServeConfig(ray_address="ray://head:10001"), "ray://head:10001"), (ServeConfig(), None)):
        cmd = cfg.submit_command(["job_a.yaml", "job_b.yaml"])
        assert cmd[:3] == [sys.executable, "-m", "batchgen"]
        params = submit.make_context("submit", cmd[4:]).params
        assert params["ray_address"] == address and params["replicas"] == cfg.replicas
        assert list(params["job_files"]) == ["job_a.yaml", "job_b.yaml"] and params["quiet"]
    r = CliRunner().invoke(main, ["serve", "--no-auth", "--replicas", "2"])
    assert r.exit_code == 2 and "needs --ray" in r.output
