"""OpenAI Batch files: input.format / output.format openai_batch (pipeline/io/openai_batch.py), on the tiny Llama with a
chat template: good, malformed and unsupported lines, per-request sampling, shared system prompts planned as
shared prefixes, and an output that has the Batch API's shape."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipeline.io.openai_batch import read_output
from pipeline.job.job_file import load_job
from pipeline.run.runner import RunOptions, run_jobs

ENGINE = "engine:\n  dtype: float32\n  block_size: 16\n  max_num_seqs: 4\n  max_num_batched_tokens: 512\n"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SYSTEM = ("You are a support analyst. Summarize the customer's message in one sentence, naming the product and "
          "what the customer wants. Keep the policy in mind: refunds within 30 days, replacements for damage.")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory, tiny_llama_dir):
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_llama_dir, path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(path)


def req(cid, messages, url="/v1/chat/completions", **body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"model": "gemma-3-270m", "messages": messages, **body}})


def sys_user(text, system=SYSTEM):
    return [{"role": "system", "content": system}, {"role": "user", "content": text}]


LINES = [
    req("r1", sys_user("My charger stopped working after a week."), max_tokens=6),
    req("r2", sys_user("The screen arrived cracked, I want a replacement."), temperature=0),
    "{not json",
    req("r4", sys_user("hello"), tools=[{"type": "function"}]),
    req("r5", sys_user("hello"), n=2),
    req("r6", sys_user("hello"), url="/v1/embeddings"),
    req("r7", [{"role": "developer", "content": SYSTEM},
               {"role": "user", "content": [{"type": "text", "text": "Refund "}, {"type": "text", "text": "please"}]}],
        stop="\n", max_completion_tokens=5),
    req("r8", sys_user("hello"), temperature=-1),
    "",
    req("r9", sys_user("Where is my invoice?", system="You are a billing assistant."), max_tokens=4),
]


def write_job(tmp_path, model, out_format="openai_batch", name="ob", lines=LINES):
    data = tmp_path / "requests.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / ("out/results.jsonl" if out_format == "openai_batch" else "out/results.parquet")
    job = tmp_path / f"{name}.yaml"
    job.write_text(f"name: {name}\nmodel: {model}\ninput:\n  path: {data}\n  format: openai_batch\n"
                   f"generation:\n  max_tokens: 8\n  temperature: 0.0\n"
                   f"output:\n  path: {out}\n  format: {out_format}\n" + ENGINE)
    return job, out


def _check_shape(line: dict) -> None:
    """The Batch output line schema (what openai.types.batch / chat.completion validate)."""
    assert set(line) == {"id", "custom_id", "response", "error"} and line["id"].startswith("batch_req_")
    if line["error"] is not None:
        assert line["response"] is None and set(line["error"]) == {"code", "message"}
        return
    r = line["response"]
    assert r["status_code"] == 200 and isinstance(r["request_id"], str)
    b = r["body"]
    assert b["object"] == "chat.completion" and isinstance(b["created"], int) and b["id"].startswith("chatcmpl-")
    [choice] = b["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["finish_reason"] in ("stop", "length")
    u = b["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert 0 <= u["prompt_tokens_details"]["cached_tokens"] <= u["prompt_tokens"]
    from openai.types.chat import ChatCompletion  # the test extra installs openai: a missing one fails
    ChatCompletion.model_validate(b)


def test_good_malformed_and_unsupported_lines(tmp_path, chat_model):
    job, out = write_job(tmp_path, chat_model)
    [report] = run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    lines = read_output(out)
    assert [ln["custom_id"] for ln in lines] == ["r1", "r2", "<null id at row 2>", "r4", "r5", "r6", "r7", "r8",
                                                  "r9"]
    for ln in lines:
        _check_shape(ln)
    by = {ln["custom_id"]: ln for ln in lines}
    errors = {k: v["error"]["message"] for k, v in by.items() if v["error"]}
    assert set(errors) == {"<null id at row 2>", "r4", "r5", "r6", "r8"}
    assert "line 3: not valid JSON" in errors["<null id at row 2>"]
    assert "body.tools is not supported" in errors["r4"]
    assert "body.n = 2 is not supported" in errors["r5"]
    assert "line 6: url '/v1/embeddings' is not supported" in errors["r6"]
    assert errors["r8"].startswith("body: ") and "temperature" in errors["r8"]
    usage = {k: v["response"]["body"]["usage"] for k, v in by.items() if not v["error"]}
    # per-request max_tokens (r1: 6, r7: max_completion_tokens 5, r9: 4; r2 the job's 8), unless EOS / stop first
    assert usage["r1"]["completion_tokens"] <= 6 and usage["r7"]["completion_tokens"] <= 5
    assert usage["r9"]["completion_tokens"] <= 4 and usage["r2"]["completion_tokens"] <= 8
    # r1, r2 and r7 share the system prompt (developer -> system): one head, prefilled once
    assert usage["r2"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["r7"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert usage["r9"]["prompt_tokens_details"]["cached_tokens"] < usage["r2"]["prompt_tokens_details"]["cached_tokens"]
    [jr] = report.jobs
    assert jr.num_rows == 9 and jr.row_errors == 5


def test_rerun_is_up_to_date_and_a_changed_body_recomputes_only_its_row(tmp_path, chat_model):
    job, out = write_job(tmp_path, chat_model)
    run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    first = read_output(out)
    from pipeline.run.validate import load_valid_jobs
    [again_job] = load_valid_jobs([str(job)])          # the JSONL output file exists now: still a valid job
    [report] = run_jobs([again_job], options=RunOptions(quiet=True, record_history=False))
    assert report.jobs[0].up_to_date
    changed = LINES.copy()
    changed[0] = req("r1", sys_user("My charger stopped working after a week."), max_tokens=3)
    job, out = write_job(tmp_path, chat_model, lines=changed)
    [report] = run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    jr = report.jobs[0]
    assert jr.computed == 1 and jr.changed == 1
    again = read_output(out)
    assert again[0]["response"]["body"]["usage"]["completion_tokens"] <= 3
    # every reused row keeps its response; "created" is the output file's write time (results keep no clock)
    def unchanged(lines):
        return [{**r, "body": {k: v for k, v in r["body"].items() if k != "created"}} if r else r
                for r in (ln["response"] for ln in lines)]
    assert unchanged(again[1:]) == unchanged(first[1:])
    assert again[1]["response"]["body"]["created"] >= first[1]["response"]["body"]["created"]


def test_openai_input_to_parquet_output(tmp_path, chat_model):
    job, out = write_job(tmp_path, chat_model, out_format="parquet")
    run_jobs([load_job(job)], options=RunOptions(quiet=True, record_history=False))
    t = pq.read_table(out)
    assert t.column("custom_id").to_pylist()[:2] == ["r1", "r2"] and t.num_rows == 9
    assert t.column("error").null_count == 4


def test_job_file_problems(tmp_path, chat_model):
    from pipeline.problems import JobError
    job, _ = write_job(tmp_path, chat_model)
    job.write_text(job.read_text() + "prompt:\n  system: hi\n")
    with pytest.raises(JobError, match="prompt.system: not used with input.format openai_batch"):
        load_job(job)
    from pipeline.run.validate import load_valid_jobs
    job, _ = write_job(tmp_path, chat_model)
    job.write_text(job.read_text().replace(str(tmp_path / "requests.jsonl"), str(tmp_path / "missing.jsonl")))
    with pytest.raises(JobError, match="missing.jsonl: no such file"):
        load_valid_jobs([str(job)])


def test_sample_job_parses():
    root = Path(__file__).resolve().parents[1]
    job = load_job(root / "jobs/openai-batch.yaml")
    assert job.input.format == "openai_batch" and job.output.format == "openai_batch"
    assert (root / job.input.path).is_file()
