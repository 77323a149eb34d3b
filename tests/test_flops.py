"""FLOP/byte counts of costmodel.flops against hand-computed cases and MACHINE.md's gemma-3-270m figures."""
from __future__ import annotations

import pytest

from costmodel import flops
from engine.models.config import ModelConfig


def gemma_270m() -> ModelConfig:
    """gemma-3-270m as MACHINE.md describes it (18 layers, layers 5/11/17 global, window 512)."""
    types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    return ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=262_144, hidden_size=640,
                       intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, max_position_embeddings=32_768, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True, qk_norm=True, sandwich_norm=True, sliding_window=512,
                       layer_types=types)


def tiny(window: int | None = None, layers: tuple[str, ...] = ()) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=8, intermediate_size=16,
                       num_hidden_layers=max(1, len(layers)), num_attention_heads=2, num_key_value_heads=1,
                       head_dim=4, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1e4,
                       sliding_window=window, layer_types=layers)


def test_gemma_270m_matches_machine_md():
    cfg = gemma_270m()
    per_token_layers = flops.linear_flops(cfg, 1)
    assert per_token_layers == pytest.approx(0.2e9, rel=0.02)          # ~0.2 GFLOP per prompt token
    assert flops.lm_head_flops(cfg, 1) == pytest.approx(0.34e9, rel=0.02)   # 0.34 GFLOP per sampled token
    # The LM head is ~63 % of the parameters (tied embedding).
    assert flops.lm_head_params(cfg) / flops.num_params(cfg) == pytest.approx(0.63, abs=0.02)
    # KV cache 18 KiB/token in bf16.
    assert cfg.num_hidden_layers * flops.kv_bytes_per_token_layer(cfg, 2) == 18 * 1024


def test_tiny_layer_params_by_hand():
    cfg = tiny()
    # q 8x8, k 8x4, v 8x4, o 8x8, mlp 3*8*16
    assert flops.layer_params(cfg) == 64 + 32 + 32 + 64 + 384
    assert flops.linear_flops(cfg, 3) == 2 * 576 * 3
    assert flops.lm_head_flops(cfg, 2) == 2 * 8 * 100 * 2


def test_attention_flops_full_and_sliding():
    full = tiny()
    # 3 new tokens after 2 cached: keys 3 + 4 + 5 = 12; 4 * heads(2) * head_dim(4) = 32 per key
    assert flops.attention_flops(full, 3, context_len=2) == 32 * 12
    slid = tiny(window=4, layers=("sliding_attention",))
    # same queries, window 4: keys 3 + 4 + 4 = 11
    assert flops.attention_flops(slid, 3, context_len=2) == 32 * 11
    mixed = tiny(window=4, layers=("sliding_attention", "full_attention"))
    assert flops.attention_flops(mixed, 3, context_len=2) == 32 * (11 + 12)
    # Long sequence: a sliding layer attends to at most window keys per query.
    assert flops.attended_keys(slid, 1000) == sum(min(k, 4) for k in range(1, 1001))
    assert flops.attended_keys(full, 10, 5) == sum(range(6, 16))


def test_prefill_and_decode_flops_compose():
    cfg = tiny(window=4, layers=("sliding_attention", "full_attention"))
    assert flops.prefill_flops(cfg, 5, 0) == (flops.linear_flops(cfg, 5) + flops.attention_flops(cfg, 5, 0)
                                              + flops.lm_head_flops(cfg, 1))
    # A decode step over contexts [3, 7] = two single queries at positions 2 and 6.
    want = (flops.linear_flops(cfg, 2) + flops.attention_flops(cfg, 1, 2) + flops.attention_flops(cfg, 1, 6)
            + flops.lm_head_flops(cfg, 2))
    assert flops.decode_step_flops(cfg, [3, 7]) == want


def test_decode_step_bytes_window_limited():
    cfg = tiny(window=4, layers=("sliding_attention", "full_attention"))
    per = 2 * 1 * 4 * 2                                   # K+V, 1 kv head, head_dim 4, bf16
    weights = (2 * 576 + 800) * 2
    # context 10: the sliding layer reads 4 tokens, the full layer 10; plus one token written per layer
    assert flops.decode_step_bytes(cfg, [10], 2) == weights + per * (4 + 10) + per * 2
    assert flops.decode_step_bytes(cfg, [], 2) == 0


def test_config_round_trip():
    cfg = gemma_270m()
    assert flops.from_dict(flops.to_dict(cfg)) == cfg


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 700), (300, 900), (512, 513), (600, 2000), (5, 4)])
def test_keys_read_range_is_the_sum_of_keys_read(lo, hi):
    """The closed form the time prediction uses for a prefill chunk equals summing query by query."""
    windows = flops.window_counts(gemma_270m())
    assert flops.keys_read_range(windows, lo, hi) == sum(flops.keys_read(windows, c) for c in range(lo, hi + 1))
