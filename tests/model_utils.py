"""Test helpers: tiny random HF checkpoints, and running our model over a sequence in chunks."""
from __future__ import annotations

import torch

from bench import quality
from engine.attention import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.loader.resolve import ModelSource
from engine.loader.safetensors_loader import load_safetensors_weights
from engine.model_runner import bind_kv_caches
from engine.models import build_model
from engine.models.config import ModelConfig


def tiny_hf_model(arch: str, **overrides):
    """A tiny random transformers model of the given architecture (float32, eval mode)."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "llama3":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "tie_word_embeddings": True}, rope_theta=1000000.0)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1000000.0)
        cls = tf.Qwen3ForCausalLM
    elif arch == "gemma3":
        cfg = tf.Gemma3TextConfig(**{**common, "tie_word_embeddings": True, "num_hidden_layers": 4,
                                     "num_key_value_heads": 1}, head_dim=32, sliding_window=8,
                                  layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                               "sliding_attention"],
                                  query_pre_attn_scalar=24, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                  hidden_activation="gelu_pytorch_tanh")
        cls = tf.Gemma3ForCausalLM
    else:
        raise ValueError(arch)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = cls(cfg).float().eval()
    if arch == "gemma3":  # HF inits norm weights to zero for Gemma (1 + w): perturb so the offset is exercised
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n:
                    p.normal_(0, 0.1)
    return model


VOCAB = 320
_CORPUS = ["The quick brown fox jumps over the lazy dog.", "Summaries of support tickets, invoices and reports.",
           "naïve café — 東京 🙂 numbers 12345 and code: def f(x): return x * 2"] * 20


def tiny_tokenizer():
    """A small byte-level BPE tokenizer (no download), with <s> as BOS and </s> as EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def save_tiny(model, path) -> ModelSource:
    """Save a tiny model with a tokenizer as an HF checkpoint directory our loader accepts."""
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = 1, 2, 0
    model.save_pretrained(path, safe_serialization=True)
    tiny_tokenizer().save_pretrained(path)
    return ModelSource(kind="hf", path=path, name=str(path))


def load_ours(source: ModelSource, dtype=torch.float32):
    mcfg = ModelConfig.from_hf_dir(source.path)
    return build_model(mcfg, load_safetensors_weights(source.path, dtype), dtype, torch.device("cpu"))


# The teacher-forced helpers live in bench.quality (the quality measurement uses them too).
bind_cache = quality.bind_cache
run_chunks = quality.sequence_logits


def hf_greedy(hf, ids: list[int], n: int, device="cpu") -> list[int]:
    """transformers' ``n`` greedy tokens after ``ids``, by a plain KV-cached loop (the reference; the engine never
    calls ``generate``), on ``device`` (the model's)."""
    ref, past, x = [], None, torch.tensor([ids], device=device)
    with torch.no_grad():
        for _ in range(n):
            out = hf(x, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = int(out.logits[0, -1].argmax())
            ref.append(nxt)
            x = torch.tensor([[nxt]], device=device)
    return ref


def hf_from_gguf(path) -> torch.nn.Module:
    """transformers' float32 model of a GGUF file (its own dequantization: the reference our loader is held to)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(path), return_tensors=False)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**parsed["config"])).float().eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=hf)["tensors"]
    missing, unexpected = hf.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    assert not unexpected and all("lm_head" in m for m in missing)
    hf.tie_weights()
    return hf
