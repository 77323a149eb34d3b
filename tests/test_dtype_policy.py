"""dtype: auto chooses by device and instruction set; an explicit slow choice still works but warns."""
import logging

import pytest
import torch

from engine import dtype_policy
from engine.dtype_policy import choose_dtype
from engine.kernels.cpu_features import cpu_features

AMX = frozenset({"amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma"})        # Sapphire Rapids
ZEN4 = frozenset({"avx512_bf16", "avx512f", "avx2", "fma"})                   # AVX512-BF16, no AMX
SKYLAKE_X = frozenset({"avx512f", "avx2", "fma"})                             # AVX-512 without BF16
ZEN3 = frozenset({"avx2", "fma"})                                             # AVX2 + FMA only
AARCH64 = frozenset()                                                         # none of the x86 flags


@pytest.mark.parametrize("features, want", [(AMX, "bfloat16"), (ZEN4, "bfloat16"), (SKYLAKE_X, "float32"),
                                            (ZEN3, "float32"), (AARCH64, "float32")],
                         ids=["amx", "avx512-bf16", "avx512-no-bf16", "avx2-only", "aarch64"])
def test_auto_on_cpu(features, want):
    choice = choose_dtype("auto", "cpu", features)
    assert choice.dtype == want and not choice.slow
    assert choice.torch_dtype == {"bfloat16": torch.bfloat16, "float32": torch.float32}[want]
    if want == "float32":
        assert choice.reason == ("float32 chosen: this CPU has no bf16 matmul units (no AMX-BF16 or AVX512-BF16)")
    else:
        assert choice.reason.startswith("bfloat16 chosen: this CPU has bf16 matmul units")
        assert ("AMX-BF16" if "amx_bf16" in features else "AVX512-BF16") in choice.reason


@pytest.mark.parametrize("bf16, want", [(True, "bfloat16"), (False, "float16")])
def test_auto_on_cuda(bf16, want):
    choice = choose_dtype("auto", "cuda", cuda_bf16=bf16)
    assert choice.dtype == want and not choice.slow and want in choice.reason


def test_explicit_choices_are_kept():
    assert choose_dtype("float32", "cpu", AMX).dtype == "float32"
    assert choose_dtype("bfloat16", "cpu", ZEN4) == dtype_policy.DtypeChoice("bfloat16", "bfloat16 requested")
    assert choose_dtype("bfloat16", "cuda", cuda_bf16=False).dtype == "bfloat16"


@pytest.mark.parametrize("features", [ZEN3, SKYLAKE_X, AARCH64])
def test_explicit_bfloat16_without_bf16_units_is_kept_but_flagged_slow(features):
    choice = choose_dtype("bfloat16", "cpu", features)
    assert choice.dtype == "bfloat16" and choice.slow
    assert "no bf16 matmul units" in choice.reason and "float32" in choice.reason


def test_this_machine_features_agree_with_torch():
    feats = cpu_features()
    assert feats <= {"amx_bf16", "avx512_bf16", "avx512f", "avx2", "fma"}
    if torch.cpu._is_avx512_bf16_supported():
        assert "avx512_bf16" in feats and choose_dtype("auto", "cpu").dtype == "bfloat16"


@pytest.mark.parametrize("features, want", [(ZEN3, "float32"), (ZEN4, "bfloat16")])
def test_engine_uses_the_choice_and_reports_it(features, want, tmp_path, monkeypatch, caplog):
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    monkeypatch.setattr(dtype_policy, "cpu_features", lambda: features)
    path = save_tiny(tiny_hf_model("llama"), tmp_path).path
    with caplog.at_level(logging.INFO, logger="batchgen.engine"):
        llm = LLM(str(path), num_gpu_blocks_override=8, device="cpu")
    assert llm.info.config.dtype == want
    assert llm.info.format.dtype.reason == choose_dtype("auto", "cpu", features).reason
    assert sum("dtype: " in r.getMessage() for r in caplog.records) == 1                 # logged once
    assert next(p for p in llm.model.parameters()).dtype == getattr(torch, want)


def test_engine_warns_on_explicit_slow_bfloat16(tmp_path, monkeypatch, caplog):
    from engine import LLM
    from tests.model_utils import save_tiny, tiny_hf_model
    monkeypatch.setattr(dtype_policy, "cpu_features", lambda: ZEN3)
    path = save_tiny(tiny_hf_model("llama"), tmp_path).path
    with caplog.at_level(logging.INFO, logger="batchgen.engine"):
        llm = LLM(str(path), dtype="bfloat16", num_gpu_blocks_override=8, device="cpu")
    assert llm.info.config.dtype == "bfloat16"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "dtype: " in r.getMessage()]
    assert len(warnings) == 1 and "no bf16 matmul units" in warnings[0].getMessage()
