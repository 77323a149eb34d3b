"""``LLM(DIR, load_format="dummy")`` on a directory holding only config.json: the engine runs on made-up weights
from token ids (no tokenizer), the same weights every time; the peers' checkpoint written by
bench/dummy_checkpoint.py holds exactly those weights (transformers loads it and gives our greedy tokens);
a bad directory or load_format is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.dummy_checkpoint import write_checkpoint
from engine import LLM, ConfigError, ModelLoadError, SamplingParams
from engine.loader.dummy import dummy_weights
from engine.loader.resolve import resolve_model
from engine.models.config import ModelConfig
from engine.tokenizer import TokenIdsOnly, load_tokenizer
from tests.model_utils import hf_greedy

CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 256, "hidden_size": 128,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
          "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}
PROMPT = [1, 17, 42, 99, 5, 200, 31, 7, 64, 128, 3, 250]
OPTS = dict(dtype="float32", quantization="none", kv_cache_dtype="float32", num_gpu_blocks_override=64,
            max_model_len=256, speculative_config=None)


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("dummy-qwen2")
    (path / "config.json").write_text(json.dumps(CONFIG))
    return path


def _greedy(llm: LLM, n: int = 8) -> list[int]:
    (out,) = llm.generate([PROMPT], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    return list(out.token_ids), out.text


def test_runs_from_token_ids_with_no_tokenizer_and_the_same_weights_each_time(config_dir):
    a = LLM(str(config_dir), load_format="dummy", **OPTS)
    tokens, text = _greedy(a)
    assert len(tokens) == 8 and text == ""
    assert isinstance(a.get_tokenizer(), TokenIdsOnly) and a.get_tokenizer().bos_token_id == 1
    assert a.info.name == config_dir.name
    assert _greedy(LLM(str(config_dir), load_format="dummy", **OPTS))[0] == tokens
    with pytest.raises(ModelLoadError, match="has no tokenizer .*give prompts as token ids"):
        a.generate(["some text"], SamplingParams(max_tokens=2))


def test_the_peers_checkpoint_holds_the_same_weights(config_dir, tmp_path):
    import transformers as tf

    out = write_checkpoint(config_dir, tmp_path / "ckpt", dtype=torch.float32)
    assert write_checkpoint(config_dir, tmp_path / "ckpt", dtype=torch.float32) == out     # kept, not rewritten
    hf = tf.AutoModelForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32).eval()
    ours = dummy_weights(ModelConfig.from_hf(CONFIG))
    theirs = dict(hf.named_parameters())
    assert all(torch.equal(theirs[k], v) for k, v in ours.items() if k in theirs)
    assert _greedy(LLM(str(config_dir), load_format="dummy", **OPTS))[0] == hf_greedy(hf, PROMPT, 8)


def test_sharded_checkpoint_has_an_index(config_dir, tmp_path):
    out = write_checkpoint(config_dir, tmp_path / "sharded", dtype=torch.bfloat16, shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert isinstance(load_tokenizer(resolve_model(out)), TokenIdsOnly)        # no tokenizer files in it either


def test_bad_directory_or_load_format_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="load_format dummy needs a directory with a config.json"):
        LLM(str(tmp_path), load_format="dummy", **OPTS)
    with pytest.raises(ConfigError, match="load_format must be auto or dummy"):
        LLM(str(tmp_path), load_format="random", **OPTS)


def test_a_text_job_on_a_model_with_no_tokenizer_is_refused_by_name(config_dir, tmp_path, monkeypatch):
    """``batchgen plan`` (and a run) render text prompts: on a config-only directory that is one message and exit
    code 2, not a traceback."""
    from click.testing import CliRunner

    from batchgen.cli import main

    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path / "cache"))
    data = Path(__file__).resolve().parent.parent / "sample_data" / "documents.parquet"
    job = tmp_path / "job.yaml"
    job.write_text(f"""name: dummy-text
model: {config_dir}
engine:
  load_format: dummy
input:
  path: {data}
  id_column: id
  limit: 4
prompt:
  document_column: document
  template: "Summarize:\\n{{document}}"
generation:
  max_tokens: 4
output:
  path: {tmp_path / "out.parquet"}
""")
    res = CliRunner().invoke(main, ["plan", str(job)])
    assert res.exit_code == 2, res.output
    assert "has no tokenizer" in res.output and "add the tokenizer's files" in res.output
