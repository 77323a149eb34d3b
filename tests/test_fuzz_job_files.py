"""Fuzz: random job files through ``batchgen validate`` and ``batchgen plan`` always end cleanly (issue 40 D): exit 0,
or 1 / 2 with a message, never a traceback. Known keys get values of random types; templates are built from text,
braces, colons, exclamation marks and known / unknown names; paths point at real inputs, outputs inside them,
files outside the job's folder, or nowhere. ``plan`` loads no weights (the tiny Llama's config and tokenizer only)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchgen.cli import main
from tests.conftest import make_docs

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 70000), st.floats(allow_nan=True, width=32),
                    st.text(max_size=12), st.sampled_from(["", "auto", "off", "0", "yes", "{document}", "-1"]))
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
PIECES = ["{", "}", "{{", "}}", ":", "!", "text ", "\n", "{document}", "{system}", "{reference}", "{category}",
          "{id}", "{nope}", "{summaries}", "{}", "{0}", "d", ">9", "r", "z", "[", "."]
SAFE = st.lists(st.sampled_from(["text ", "\n", "{system}", "{reference}", "{category}", "{{", "}}", ":", "!",
                                 "{{x}}"]), max_size=4).map("".join)
HAZARDS = ["", "{", "}", "{nope}", "{}", "{0}", "{system:d}", "{system!r}", "{reference:{document}}", "{system:>9}",
           "{system!z}", "{id:}", "{document!s}", "{summaries}", "{system.x}", "{category[0]}", "{document:d}"]
TEMPLATES = st.one_of(
    st.lists(st.sampled_from(PIECES), max_size=10).map("".join),                    # anything
    st.builds(lambda a, hazard, doc, b: a + hazard + doc + b, SAFE,              # mostly good, at most one hazard
              st.one_of(st.just(""), st.sampled_from(HAZARDS)), st.sampled_from(["{document}", " {document}\n", ""]),
              SAFE),
)


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama_dir):
    root = tmp_path_factory.mktemp("fuzz")
    (root / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(make_docs(6)), root / "in" / "docs.parquet")
    (root / "schema.json").write_text(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
    (root / "bad.json").write_text("{not json")
    (root / "g.lark").write_text("start: \"yes\" | \"no\"\n")
    return {"root": root, "model": tiny_llama_dir}


def _paths(w, jobdir: Path):
    root = w["root"]
    return {
        "input": st.one_of(st.sampled_from([str(root / "in"), str(root / "in" / "docs.parquet"),
                                            str(root / "in" / "*.parquet"), str(root / "nothing"), "s3:/x",
                                            str(root / "schema.json")]), VALUES),
        "output": st.one_of(st.sampled_from([str(jobdir / "out.parquet"), str(jobdir / "out"),
                                             str(root / "in" / "out.parquet"), str(root / "in"),
                                             str(root / "in" / "docs.parquet"), "out.jsonl"]), VALUES),
        "file": st.sampled_from(["../schema.json", str(root / "schema.json"), "../bad.json", "../g.lark",
                                 "missing.json", "x.lark", "/dev/null", "{\"type\": \"string\"}"]),
    }


def _mutations(w, jobdir: Path) -> list[tuple[tuple[str, ...], st.SearchStrategy]]:
    """(key path, values for it): the keys a job file has, each with plausible and random values."""
    p = _paths(w, jobdir)
    so = st.one_of(st.fixed_dictionaries({}, optional={"json": st.one_of(p["file"], VALUES), "grammar": p["file"],
                                                        "regex": st.text(max_size=8), "choice": VALUES,
                                                        "json_object": VALUES}), VALUES)
    return [
        (("name",), VALUES), (("model",), st.one_of(st.just("/nonexistent/model"), VALUES)), (("bogus",), VALUES),
        (("input",), VALUES), (("input", "path"), p["input"]),
        (("input", "format"), st.one_of(st.sampled_from(["parquet", "datasets", "openai_batch"]), VALUES)),
        (("input", "id_column"), VALUES), (("input", "limit"), VALUES), (("input", "unknwon"), VALUES),
        (("prompt",), VALUES), (("prompt", "template"), st.one_of(TEMPLATES, VALUES)),
        (("prompt", "reduce_template"), st.one_of(TEMPLATES, VALUES)), (("prompt", "system"), VALUES),
        (("prompt", "system_column"), VALUES), (("prompt", "reference_column"), VALUES),
        (("prompt", "document_column"), VALUES), (("prompt", "chat_template"), VALUES),
        (("prompt", "on_too_long"), st.one_of(st.just("map_reduce"), VALUES)),
        (("generation",), VALUES), (("generation", "max_tokens"), st.one_of(st.integers(-1, 20), VALUES)),
        (("generation", "temperature"), VALUES), (("generation", "stop"), VALUES), (("generation", "seed"), VALUES),
        (("generation", "structured_outputs"), so),
        (("output",), VALUES), (("output", "path"), p["output"]), (("output", "format"), VALUES),
        (("output", "include_columns"), VALUES), (("output", "rows_per_shard"), VALUES),
        (("engine",), VALUES), (("engine", "block_size"), VALUES), (("engine", "max_num_seqs"), VALUES),
        (("engine", "max_model_len"), VALUES), (("engine", "dtype"), VALUES), (("schedule",), VALUES),
        (("allow_outside_files",), VALUES),
    ]


def job_files(draw, w, jobdir: Path) -> dict:
    """A good job with a random template, then 0-3 keys set to random values or removed."""
    doc = {"name": "fz", "model": w["model"], "input": {"path": str(w["root"] / "in"), "id_column": "id"},
           "prompt": {"system": "S", "reference_column": "reference", "document_column": "document",
                      "template": draw(st.one_of(TEMPLATES, st.just("{system} {document}")))},
           "generation": {"max_tokens": 4}, "output": {"path": str(jobdir / "out.parquet")}}
    mutations = _mutations(w, jobdir)
    count = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))                # a third of the jobs stay good but the template
    for i in draw(st.lists(st.integers(0, len(mutations) - 1), min_size=count, max_size=count)):
        keys, values = mutations[i]
        node = doc
        for k in keys[:-1]:
            node = node.setdefault(k, {}) if isinstance(node.get(k, {}), dict) else {}
        if draw(st.integers(0, 5)) == 0:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = draw(values)
    return doc


def _check(args: list[str]) -> None:
    res = CliRunner().invoke(main, args)
    event(f"{args[0]} exit {res.exit_code}")
    assert "Traceback" not in res.output, res.output
    assert res.exit_code in (0, 1, 2), (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), (res.exception, res.output)
    if res.exit_code:
        assert res.output.strip(), "a failure without a message"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=st.data())
def test_random_job_files_validate_and_plan_cleanly(world, data, monkeypatch):
    import pipeline.run.runner

    def no_weights(config):                        # plan is a dry run: it must never build a computing engine
        raise AssertionError("plan loaded a model")
    monkeypatch.setattr(pipeline.run.runner, "default_llm_factory", no_weights)
    jobdir = Path(tempfile.mkdtemp(dir=world["root"]))
    doc = job_files(data.draw, world, jobdir)
    text = yaml.safe_dump(doc, allow_unicode=True)
    if data.draw(st.integers(0, 9)) == 0:          # sometimes a damaged file: cut anywhere
        text = text[:data.draw(st.integers(0, len(text)))]
    path = jobdir / "job.yaml"
    path.write_text(text, encoding="utf-8")
    for command in ("validate", "plan"):
        _check([command, str(path)])
