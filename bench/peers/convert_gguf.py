"""A GGUF checkpoint as an HF bf16 safetensors directory with its tokenizer, for the peers that do not read
GGUF (vLLM's CPU backend; OpenVINO's export reads this directory). Runs INSIDE a peer venv (torch, transformers,
gguf), once, from bench/peers/setup.sh:

    python convert_gguf.py MODEL.gguf OUT_DIR

The weights are dequantized as they load (``GgufConfig(dequantize=True)`` where transformers has it: newer
releases refuse to save a GGUF-quantized model), the quantizer is dropped, the model is cast to bf16 and saved.
Checks: the saved copy reloads and gives the same greedy tokens as the model in memory; how many of the first
greedy tokens match the float32 GGUF-loaded model is printed (bf16 may part from it late).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

try:
    from transformers import GgufConfig
except ImportError:          # older transformers dequantize GGUF weights anyway
    GgufConfig = None

CHECK_PROMPT = "The quarterly report says that the warehouse"
CHECK_TOKENS = 24


def greedy(model, ids: torch.Tensor) -> list[int]:
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=CHECK_TOKENS, do_sample=False, min_new_tokens=CHECK_TOKENS)
    return out[0, ids.shape[1]:].tolist()


def main(gguf: str, out: str) -> None:
    src, dst = Path(gguf), Path(out)
    kw = {"quantization_config": GgufConfig(dequantize=True)} if GgufConfig is not None else {}
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32, **kw)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model.hf_quantizer = None                       # NOTE: dequantized: a plain model, saved as one
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.eval()
    ids = tok(CHECK_PROMPT, return_tensors="pt").input_ids
    ref32 = greedy(model, ids)
    model = model.to(torch.bfloat16)
    ref16 = greedy(model, ids)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    again = greedy(AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).eval(), ids)
    if again != ref16:
        raise SystemExit(f"the saved copy generates {again}, the model in memory {ref16}: not converted")
    same = next((i for i, (a, b) in enumerate(zip(ref16, ref32)) if a != b), len(ref16))
    print(f"saved {dst}: bf16 greedy tokens reload identically; the first {same} of {CHECK_TOKENS} equal the "
          f"float32 GGUF model's", file=sys.stderr)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


if __name__ == "__main__":
    main(*sys.argv[1:3])
