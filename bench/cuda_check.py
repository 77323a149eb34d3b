"""The CUDA path, checked and measured in one run on a lent GPU (the device tool; never part of CI).

    python -m bench.cuda_check [--out DIR] [--device cuda] [--models NAME,...] [--budget-s 400] [--quick]

1. The machine: torch, the GPU, flash-attn; its bf16 matmul peak and memory bandwidth, measured here.
2. Correctness on tiny random checkpoints of every architecture (float32): the engine on the device against
   transformers on the device (greedy tokens, and logits of every sampled step, teacher-forced), against the engine
   on the CPU, alone vs batched, whole vs chunked prefill; bf16 against float32 (agreement, informational).
3. Speed on real model shapes (``load_format: dummy``, bf16): prefill tokens/s as a fraction of the measured matmul
   peak (MFU) and decode at 1 row as a fraction of the measured read bandwidth (MBU), plus decode at 64 rows.

Every check prints one JSON line; all of them go to DIR/cuda_check.json. A check that fails is reported with its
error and the run goes on. ``--device cpu --quick`` runs the same code here (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

MODELS = Path(__file__).parent / "models"
RESULTS: list[dict] = []


def report(kind: str, **fields) -> dict:
    row = {"check": kind, **fields}
    RESULTS.append(row)
    print(json.dumps(row, default=str), flush=True)
    return row


def guarded(kind: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:              # NOTE: one broken check must not cost the others (one lease, one run)
        report(kind, ok=False, error=f"{type(e).__name__}: {e}", trace=traceback.format_exc()[-2000:])
        return None


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed(dev: torch.device, fn, reps: int, warm: int = 2) -> float:
    """Mean seconds of ``fn()`` over ``reps`` after ``warm`` calls."""
    for _ in range(warm):
        fn()
    sync(dev)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(dev)
    return (time.perf_counter() - t) / reps


def machine(dev: torch.device, quick: bool) -> dict:
    from engine.attention.selector import flash_attn_available
    info = {"torch": torch.__version__, "device": str(dev), "flash_attn": flash_attn_available()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        info.update(name=p.name, capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1),
                    sms=p.multi_processor_count, cuda=torch.version.cuda)
    n = 1024 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    s = timed(dev, lambda: torch.mm(a, b), 3 if quick else 10)
    info["bf16_matmul_tflops"] = round(2 * n ** 3 / s / 1e12, 1)
    nbytes = (64 << 20) if quick else (4 << 30)
    x = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16).normal_()
    y = torch.empty_like(x)
    s = timed(dev, lambda: y.copy_(x), 3 if quick else 10)
    info["copy_gbs"] = round(2 * nbytes / s / 1e9, 1)                 # read + write
    s = timed(dev, lambda: x.sum(dtype=torch.float32), 3 if quick else 10)
    info["read_gbs"] = round(nbytes / s / 1e9, 1)
    return report("machine", ok=True, **info)


# -- correctness ---------------------------------------------------------------------------------------------------

def _engine(src, dev, dtype="float32", **kw):
    from engine.llm import LLM
    return LLM(str(src), dtype=dtype, device=str(dev), speculative_config=None, num_gpu_blocks_override=256,
               **kw)


def _tokens(llm, prompts, n) -> list[list[int]]:
    from engine.sampling_params import SamplingParams
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


def _sampled_logits(llm, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """The engine's logits at each of ``n`` sampled steps of one request (seeded sampling: logits are computed),
    and the tokens it drew."""
    from engine.sampling_params import SamplingParams
    model, rows = llm.model, []
    orig = model.compute_logits

    def keep(h):
        out = orig(h)
        rows.append(out.detach().float().cpu())
        return out
    model.compute_logits = keep
    try:
        out = llm.generate([prompt], SamplingParams(temperature=1.0, seed=7, max_tokens=n, ignore_eos=True))[0]
    finally:
        model.compute_logits = orig
    return list(out.token_ids), torch.cat(rows)[-n:]


def correctness(arch: str, dev: torch.device, workdir: Path) -> None:
    from tests.model_utils import VOCAB, hf_greedy, save_tiny, tiny_hf_model
    hf = tiny_hf_model(arch)
    src = save_tiny(hf, workdir / arch)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 33, 64, 9, 120)]
    n = 12
    hf_dev = hf.to(dev)
    ref = [hf_greedy(hf_dev, p, n, dev) for p in prompts]
    ours = _engine(src.path, dev)
    got = _tokens(ours, prompts, n)
    alone = [_tokens(ours, [p], n)[0] for p in prompts]
    chunked = _tokens(_engine(src.path, dev, max_num_batched_tokens=16), prompts, n)
    cpu = _tokens(_engine(src.path, torch.device("cpu")), prompts, n)

    # logits of every sampled step against transformers' teacher-forced forward over the same tokens
    worst = 0.0
    for p in prompts[1:4]:
        drawn, logits = _sampled_logits(ours, p, 4)
        with torch.no_grad():
            full = hf_dev(torch.tensor([p + drawn[:-1]], device=dev)).logits[0].float().cpu()
        want = full[len(p) - 1:]
        worst = max(worst, ((logits - want).abs().max() / max(1.0, want.abs().max().item())).item())
    bf16 = _tokens(_engine(src.path, dev, dtype="bfloat16"), prompts, n)

    def agree(a, b):
        return sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / sum(len(r) for r in a)
    ok = got == ref and got == alone and got == chunked and worst <= 1e-4
    report("correctness", ok=ok, arch=arch, device=str(dev), tokens_vs_transformers=agree(got, ref),
           batched_vs_alone=agree(got, alone), whole_vs_chunked=agree(got, chunked), device_vs_cpu=agree(got, cpu),
           logits_rel_max_diff=worst, bf16_vs_float32=agree(bf16, got),
           attention_backend=ours.info.attention_backend)


# -- speed ---------------------------------------------------------------------------------------------------------

def speed(name: str, dev: torch.device, peaks: dict, quick: bool) -> None:
    import costmodel.flops as flops
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(str(MODELS / name), load_format="dummy", dtype="bfloat16" if dev.type == "cuda" else "float32",
              device=str(dev), enable_prefix_caching=False, speculative_config=None,
              kv_cache_memory=(1 << 30) if quick else (24 << 30), max_num_seqs=64 if quick else 256,
              max_num_batched_tokens=1024 if quick else 16384, max_model_len=4096)
    load_s = time.perf_counter() - t0
    cfg, vocab = llm.model_config, llm.model_config.vocab_size
    g = torch.Generator().manual_seed(1)
    n_docs, plen = (4, 256) if quick else (64, 2048)

    def greedy(k, **kw):
        return SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, **kw)
    warm = [torch.randint(0, vocab, (64,), generator=g).tolist() for _ in range(2)]
    llm.generate(warm, greedy(4))

    # prefill: n_docs distinct prompts, one token each out
    docs = [torch.randint(0, vocab, (plen,), generator=g).tolist() for _ in range(n_docs)]
    sync(dev)
    t = time.perf_counter()
    llm.generate(docs, greedy(1))
    sync(dev)
    pre_s = time.perf_counter() - t
    pre_flops = n_docs * flops.prefill_flops(cfg, plen)
    row = {"model": name, "load_s": round(load_s, 1), "weight_gb": round(llm.info.weight_bytes / 1e9, 2),
           "prefill_tokens": n_docs * plen, "prefill_s": round(pre_s, 3),
           "prefill_tok_s": round(n_docs * plen / pre_s), "prefill_tflops": round(pre_flops / pre_s / 1e12, 1)}
    if peaks.get("bf16_matmul_tflops"):
        row["mfu_vs_measured_matmul"] = round(pre_flops / pre_s / 1e12 / peaks["bf16_matmul_tflops"], 3)

    # decode at 1 row: tpot against (weights + KV read per step) / bandwidth
    out_n = 32 if quick else 128
    o = llm.generate([docs[0][:512]], greedy(out_n))[0]
    tpot = o.metrics.tpot_s
    kv_bytes = 2 if llm.dtype != torch.float32 else 4
    step_bytes = llm.info.weight_bytes + flops.decode_step_kv_bytes(cfg, [512 + out_n // 2], kv_bytes)
    row.update(decode1_tpot_ms=round(tpot * 1e3, 3), decode1_bytes_gb=round(step_bytes / 1e9, 3),
               decode1_bound_ms=round(step_bytes / (peaks.get("read_gbs", 1) * 1e9) * 1e3, 3))
    if peaks.get("read_gbs"):
        row["mbu_decode1"] = round(step_bytes / tpot / (peaks["read_gbs"] * 1e9), 3)

    # decode at 64 rows (short prompts, long outputs): tokens/s
    rows = [torch.randint(0, vocab, (128,), generator=g).tolist() for _ in range(8 if quick else 64)]
    sync(dev)
    t = time.perf_counter()
    outs = llm.generate(rows, greedy(out_n))
    sync(dev)
    s = time.perf_counter() - t
    row.update(decode64_s=round(s, 3), decode64_tok_s=round(sum(len(x.token_ids) for x in outs) / s),
               decode64_tpot_ms=round(1e3 * sum(x.metrics.tpot_s for x in outs) / len(outs), 3))
    report("speed", ok=True, **row)
    del llm
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="qwen2.5-0.5b-instruct,llama-3.2-1b-instruct,qwen2.5-1.5b-instruct,"
                                        "qwen3-4b,llama-3.1-8b-instruct")
    ap.add_argument("--archs", default="llama,llama3,qwen2,qwen3,gemma3")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke test on the CPU)")
    a = ap.parse_args(argv)
    start = time.perf_counter()
    dev = torch.device(a.device)
    peaks = guarded("machine", machine, dev, a.quick) or {}
    with tempfile.TemporaryDirectory() as tmp:
        for arch in a.archs.split(","):
            guarded("correctness", correctness, arch, dev, Path(tmp))
    for name in a.models.split(","):
        if time.perf_counter() - start > a.budget_s:
            report("speed", ok=False, model=name, error="skipped: the time budget is spent")
            continue
        guarded("speed", speed, name, dev, peaks, a.quick)
    out = Path(a.out) / "cuda_check.json"
    out.write_text(json.dumps(RESULTS, indent=1, default=str))
    failed = [r for r in RESULTS if not r.get("ok")]
    print(f"{len(RESULTS) - len(failed)} ok, {len(failed)} failed, {time.perf_counter() - start:.0f} s; {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
