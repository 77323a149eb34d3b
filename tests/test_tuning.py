"""engine.tuning: measured defaults. The choice follows the (injected) timings, the cache is keyed by the machine and
rebuilt when damaged, explicit settings win, the probe keeps to its budget, and a tuned engine computes the same
tokens as one built with the same settings by name. No timed assertions: timings are injected (a fake clock, or a
fake ``probe.measure``) and models are tiny."""
from __future__ import annotations

import json

import pytest

import engine.tuning.candidates as candidates
import engine.tuning.decision as decision
import engine.tuning.probe as probe
from engine import EngineConfig, SamplingParams
from engine.tuning.candidates import Format, KernelFacts, format_candidates

F32, BF16, F32_KV16 = "none/float32/kv-float32", "none/bfloat16/kv-bfloat16", "none/float32/kv-bfloat16"
I8, I8_KV16 = "int8/float32/kv-float32", "int8/float32/kv-bfloat16"


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tasks(clock: FakeClock, seconds: dict[str, float], shapes, ran: list | None = None) -> list[probe.Task]:
    def fn(c):
        def run():
            clock.now += seconds[c]
            if ran is not None:
                ran.append(c)
        return run
    return [probe.Task(c, s.name, fn(c)) for s in shapes for c in seconds]


SHAPES = probe.probe_shapes(4096, 128, 32768)


def _choose(seconds: dict[str, float]) -> str:
    clock = FakeClock()
    m = probe.measure(_tasks(clock, seconds, SHAPES), clock, budget_s=1e9)
    fmts = [Format(*n.split("/")[:2], n.split("kv-")[1]) for n in seconds]
    return decision.decide({}, fmts, {}, SHAPES, m, fmts[0], 2).format.name


def test_the_choice_flips_when_a_candidate_timing_flips():
    assert _choose({F32: 1.0, BF16: 2.0}) == F32
    assert _choose({F32: 2.0, BF16: 1.0}) == BF16


def test_a_smaller_kv_cache_is_kept_within_the_margin():
    """Formats that differ only in the KV cache's dtype: within KV_MARGIN the smaller cache is kept (the probe's short
    contexts cannot tell them apart; real prompt lengths can), beyond it the faster one; formats that differ in
    their weights or activations too: the faster one, however close."""
    kv32, kv16 = "int8/float32/kv-float32", "int8/float32/kv-bfloat16"
    assert _choose({kv32: 1.0, kv16: 1.05}) == kv16
    assert _choose({kv32: 1.0, kv16: 1.0 + 2 * probe.KV_MARGIN}) == kv32
    assert _choose({kv16: 1.0, kv32: 0.99, F32_KV16: 1.5}) == kv16
    assert _choose({F32: 1.0, BF16: 1.05}) == F32
    clock = FakeClock()
    m = probe.measure(_tasks(clock, {kv32: 1.0, kv16: 1.05}, SHAPES), clock, budget_s=1e9)
    d = decision.decide({}, [Format("int8", "float32", "float32"), Format("int8", "float32", "bfloat16")], {},
                        SHAPES, m, Format("int8", "float32", "float32"), 2)
    assert d.format.name == kv16 and f"within 10% of {kv32} with a smaller KV cache" in d.reason


def test_the_probe_stops_at_its_budget_under_an_injected_clock():
    clock, ran = FakeClock(), []
    m = probe.measure(_tasks(clock, {F32: 1.0, BF16: 1.0}, SHAPES, ran), clock, budget_s=15.0)
    assert m.stopped == "budget" and m.elapsed_s <= 15.0 and clock.now <= 15.0
    assert len(ran) == 15                        # 2 warm-up runs, 13 timed: the 16th would end at 16 s
    assert m.rounds == 1 and sum(len(t) for t in m.times.values()) == 13
    # with the budget spent before any shape was timed for every candidate, the table's format is chosen
    d = decision.decide({}, [Format("none", "float32", "float32"), Format("none", "bfloat16", "bfloat16")], {},
                        SHAPES, probe.Measurement(times={}), Format("none", "bfloat16", "bfloat16"), 2)
    assert d.format.name == BF16 and "budget" in d.reason


def test_rounds_end_the_probe_before_the_budget_and_slow_formats_are_dropped():
    clock = FakeClock()
    m = probe.measure(_tasks(clock, {F32: 0.001, BF16: 0.001}, SHAPES), clock, budget_s=15.0, max_rounds=3)
    assert m.stopped == "rounds" and m.rounds == 3 and all(len(t) == 3 for t in m.times.values())
    fmts = [Format("none", "float32", "float32"), Format("none", "bfloat16", "bfloat16")]
    m = probe.measure(_tasks(clock, {F32: 0.001, BF16: 0.002}, SHAPES), clock, budget_s=15.0, max_rounds=3,
                      prune=probe._slow(fmts, SHAPES))                # 2x the best: timed in round 1 only
    assert m.pruned == [BF16] and {len(m.times[(BF16, s.name)]) for s in SHAPES} == {1}
    assert {len(m.times[(F32, s.name)]) for s in SHAPES} == {3}


def test_candidates_keep_explicit_fields_and_the_quality_bar():
    zen5 = KernelFacts("avx512_vnni", True, "avx512_bf16", True)
    names = {f.name for f in format_candidates("auto", "auto", "auto", zen5)}
    assert names == {BF16, F32, F32_KV16, I8, I8_KV16}          # no int8 + bf16 activations: it fails the bar
    assert {f.name for f in format_candidates("none", "auto", "auto", zen5)} == {BF16, F32, F32_KV16}
    assert {f.name for f in format_candidates("int8", "auto", "auto", zen5)} == {I8, I8_KV16}
    assert {f.name for f in format_candidates("auto", "float32", "float32", zen5)} == {F32, I8}
    no_bf16 = KernelFacts("avx2", False, "avx2", False)
    assert {f.name for f in format_candidates("auto", "auto", "auto", no_bf16)} == {F32, F32_KV16, I8, I8_KV16}
    no_kernels = KernelFacts()
    assert {f.name for f in format_candidates("auto", "float32", "auto", no_kernels)} == {F32, F32_KV16}


def test_int8_prompts_are_measured_only_for_int8_where_amx_prompt_rows_run():
    from engine.tuning.candidates import family_options
    amx = KernelFacts("avx512_vnni", True, "avx512_bf16", True, True, True)
    no_amx = KernelFacts("avx512_vnni", True, "avx512_bf16", True, True, False)
    int8 = Format("int8", "float32", "bfloat16")
    assert family_options(int8, amx)["int8_prompts"] == ("int8", "bf16")
    assert "int8_prompts" not in family_options(int8, no_amx)
    assert "int8_prompts" not in family_options(Format("none", "bfloat16", "bfloat16"), amx)


# ---- through setup_engine / LLM on a tiny model, with a fake probe.measure -----------------------------------
@pytest.fixture
def tuning(tmp_path, monkeypatch):
    """Tuning on, its cache in tmp_path; ``tuning.times`` (candidate -> seconds, default 1) feeds a fake measure
    that runs every task once (so the real tasks are built and run) and records the formats it was given."""
    monkeypatch.setenv("BATCHGEN_TUNE", "on")
    monkeypatch.setattr(decision, "cache_root", lambda: tmp_path)
    # NOTE: bf16 is a candidate only where the CPU has bf16 matmul units; these tests choose between float32 and
    # bf16 by injected timings, so they say it has them on every CPU (bf16 runs everywhere, only slower without)
    monkeypatch.setattr(candidates, "cpu_has_bf16_matmul", lambda features=None: True)
    calls: list[set[str]] = []

    def fake_measure(tasks, *args, **kwargs):          # the formats' phase is a call, the families' not counted
        names = {t.candidate for t in tasks}
        calls.extend([names] if any("/" in n for n in names) else [])
        m = probe.Measurement(times={}, rounds=1)
        for t in tasks:
            t.fn()
            # int8 formats (a candidate for these float checkpoints too) lose unless a test times them
            m.times[(t.candidate, t.shape)] = [state.times.get(t.candidate, 9.0 if t.candidate.startswith("int8/")
                                                                else 1.0)]
        return m

    monkeypatch.setattr(probe, "measure", fake_measure)
    state = type("Tuning", (), {"times": {}, "calls": calls, "dir": tmp_path})()
    return state


def _setup(model_dir, tune=True, retune=False, **kw):
    """What an engine's load settles (``tune``: its tuning phase measures when due), or planning (not ``tune``)."""
    from engine.setup import locate, settle
    target = locate(EngineConfig(model_dir, kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256,
                                 **kw))
    return settle(target, target.decide_format(measure=tune, retune=retune))


def test_the_decision_follows_the_timings_and_is_cached_and_recorded(tiny_llama_dir, tuning):
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0}
    s = _setup(tiny_llama_dir)
    assert (s.config.dtype, s.config.kv_cache_dtype, s.config.quantization) == ("float32", "float32", "none")
    assert len(tuning.calls) == 1 and {F32, BF16, F32_KV16} <= tuning.calls[0]
    rec = s.format.record()
    assert rec["mode"] == "tuned" and rec["source"] == "measured" and rec["choice"]["dtype"] == "float32"
    assert {c["name"]: c["score_ms"] for c in rec["candidates"]}[BF16] == pytest.approx(3000.0)
    assert F32 in rec["reason"] and s.dtype_choice.reason.startswith("tuned")
    again = _setup(tiny_llama_dir)                      # cached: not measured again
    assert len(tuning.calls) == 1 and again.format.record()["source"] == "cached"
    assert again.config.dtype == "float32"
    planning = _setup(tiny_llama_dir, tune=False)       # planning reads the cached decision too
    assert planning.config.dtype == "float32" and len(tuning.calls) == 1


def test_a_float_checkpoint_is_quantized_when_int8_measures_fastest(tiny_llama_dir, tuning):
    """int8 weights are auto's candidate for a float checkpoint too (quantized at load): the fastest format that
    passes the quality bar wins, whatever the weights' source; quantization: none keeps it float."""
    from engine.quant.policy import kernel_q8_isa
    if kernel_q8_isa() is None:
        pytest.skip("no int8 kernels in this build")
    tuning.times = {F32: 2.0, BF16: 3.0, F32_KV16: 2.0, I8: 1.5, I8_KV16: 1.0}
    s = _setup(tiny_llama_dir)
    assert I8_KV16 in tuning.calls[0] and I8 in tuning.calls[0]
    assert (s.config.quantization, s.config.dtype, s.config.kv_cache_dtype) == ("int8", "float32", "bfloat16")
    assert s.quant_choice.reason.startswith("tuned")
    kept = _setup(tiny_llama_dir, quantization="none")
    assert kept.config.quantization == "none" and not any(n.startswith("int8/") for n in tuning.calls[-1])


def test_setup_never_measures_an_engines_load_does(tiny_llama_dir, tuning):
    """setup_engine settles only what needs no weights: with no decision cached the tables decide (pending); LLM's
    tuning phase measures one, which a later setup reads and resolves to the engine's config."""
    from engine import LLM, setup_engine
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0}
    cfg = EngineConfig(tiny_llama_dir, kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256,
                       speculative_config="off")
    assert setup_engine(cfg).format.pending and not tuning.calls
    llm = LLM(config=cfg)
    assert len(tuning.calls) == 1 and llm.info.format.tuned.source == "measured"
    after = setup_engine(cfg)
    assert after.format.tuned.source == "cached" and after.config == llm.config and len(tuning.calls) == 1


def test_kernel_families_follow_their_timings(tiny_llama_dir, tuning):
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0, "elementwise:c@float32": 0.05,
                    "elementwise:torch@float32": 0.001, "lm_head:c@float32": 0.01, "lm_head:torch@float32": 0.02,
                    "linears:c@float32": 0.003, "linears:torch@float32": 0.009,
                    "prefill_linears:c@float32": 0.001, "prefill_linears:torch@float32": 0.006}
    s = _setup(tiny_llama_dir)
    assert s.kernels == {"elementwise": "torch", "lm_head": "c", "attention": "c", "linears": "c",
                         "prefill_linears": "torch",                  # not measured: a prompt's rows stay torch's
                         "int8_prompts": "int8"}                      # a float format: the table's
    assert s.config.kernels == s.kernels                 # the resolved families: recorded, and what a pin repeats
    assert s.format.record()["kernels"]["linears"]["calls_ms"]["c"]       # timed at the decode shapes
    assert "prefill_linears" not in s.format.record()["kernels"]
    tuning.times.update({"elementwise:c@float32": 0.001, "elementwise:torch@float32": 0.002,
                         "lm_head:c@float32": 0.02, "lm_head:torch@float32": 0.01,
                         "linears:c@float32": 0.09, "linears:torch@float32": 0.003})
    s = setup_retuned(tiny_llama_dir)
    assert s.kernels == {"elementwise": "c", "lm_head": "torch", "attention": "c", "linears": "torch",
                         "prefill_linears": "torch", "int8_prompts": "int8"}
    tuning.times.update({"elementwise:c@float32": 0.003, "elementwise:torch@float32": 0.002})
    s = setup_retuned(tiny_llama_dir)       # torch ahead by under FAMILY_MARGIN of the step: the table's c stays
    assert s.kernels["elementwise"] == "c" and "table's" in s.format.record()["kernels"]["elementwise"]["why"]


def test_the_attention_family_follows_its_timings_and_explicit_kernels_win(tiny_llama_dir, tuning):
    """Prefill attention over a bf16 cache is a measured family (no CPU-flag rule): C or torch, whichever's prefill
    step is faster, handed to the attention backend; a job's ``kernels`` setting wins over the measurement."""
    import engine.kernels.gemm as gemm
    if not gemm.bf16_gemm_ok():
        pytest.skip("this build has no bf16 dot products: attention has one implementation here")
    tuning.times = {F32: 3.0, BF16: 3.0, F32_KV16: 1.0, "attention:c@float32": 0.2, "attention:torch@float32": 0.1}
    s = _setup(tiny_llama_dir)
    assert s.config.kv_cache_dtype == "bfloat16" and s.kernels["attention"] == "torch"
    assert s.backend.prefill == "torch"
    assert s.format.record()["kernels"]["attention"]["chosen"] == "torch"
    tuning.times.update({"attention:c@float32": 0.1, "attention:torch@float32": 0.2})
    s = setup_retuned(tiny_llama_dir)
    assert s.kernels["attention"] == "c" and s.backend.prefill == "c"
    s = _setup(tiny_llama_dir, kernels={"attention": "torch", "elementwise": "torch"})
    assert s.kernels["attention"] == "torch" and s.kernels["elementwise"] == "torch" and s.backend.prefill == "torch"


def test_a_bad_kernels_setting_names_the_family():
    from engine import ConfigError
    with pytest.raises(ConfigError, match="unknown kernel family 'attn'"):
        EngineConfig(kernels={"attn": "c"})
    with pytest.raises(ConfigError, match="kernels.attention must be one of c, torch, got 'fast'"):
        EngineConfig(kernels={"attention": "fast"})


def setup_retuned(model_dir):
    return _setup(model_dir, retune=True)


def test_a_changed_cpu_signature_measures_again(tiny_llama_dir, tuning, monkeypatch):
    _setup(tiny_llama_dir)
    _setup(tiny_llama_dir)
    assert len(tuning.calls) == 1
    monkeypatch.setattr(decision, "cpu_signature", lambda: "flags : fpu sse2 avx2 (another CPU)")
    _setup(tiny_llama_dir)
    assert len(tuning.calls) == 2
    threads = decision.torch.get_num_threads()
    try:                                                # so does another thread count
        decision.torch.set_num_threads(1 if threads > 1 else 2)
        _setup(tiny_llama_dir)
    finally:
        decision.torch.set_num_threads(threads)
    assert len(tuning.calls) == 3 and len(list((tuning.dir / "tuning").glob("*.json"))) == 3


VALUE_DAMAGE = {"mismatch": ("key", "cpu", "another CPU", "another machine's"),   # (where, what, warning names)
                "bad dtype": ("choice", "dtype", "float8", "choice.dtype"),
                "bad kernels": ("choice", "kernels", "c", "choice.kernels"),
                "bad family": ("choice", "kernels", {"gpu": "c"}, "choice.kernels: unknown kernel family 'gpu'"),
                "no quantization": ("choice", "quantization", None, "choice.quantization"),
                "bad load": ("load_average", None, "high", "load_average must be")}


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"key": {}}), *VALUE_DAMAGE])
def test_a_corrupt_or_mismatched_decision_is_rebuilt(tiny_llama_dir, tuning, damage, caplog):
    tuning.times = {BF16: 1.0}
    s = _setup(tiny_llama_dir)
    path = next((tuning.dir / "tuning").glob("*.json"))
    named = "unusable"
    if damage in VALUE_DAMAGE:                          # a whole decision, but one field's value is wrong
        d = json.loads(path.read_text())
        top, name, value, named = VALUE_DAMAGE[damage]
        if name is None:
            d[top] = value
        elif value is None:
            del d[top][name]
        else:
            d[top][name] = value
        damage = json.dumps(d)
    path.write_text(damage)
    with caplog.at_level("WARNING", logger="batchgen.engine"):
        planning = _setup(tiny_llama_dir, tune=False).format.record()   # planning: the tables decide, measuring
    assert f"tuning decision {path} is unusable" in caplog.text and named in caplog.text
    assert planning["mode"] == "table" and planning["pending"]       # left to an engine's load
    assert not path.exists()                                                      # ... and the bad file is gone
    s = _setup(tiny_llama_dir)
    assert len(tuning.calls) == 2 and s.config.dtype == "bfloat16"
    assert json.loads(path.read_text())["choice"]["dtype"] == "bfloat16"


def test_explicit_settings_win(tiny_llama_dir, tuning):
    tuning.times = {BF16: 1.0}                          # bf16 would win every auto field
    s = _setup(tiny_llama_dir, dtype="float32")
    assert s.config.dtype == "float32" and s.dtype_choice.reason == "float32 requested"
    assert all("/float32/" in c for c in tuning.calls[0] if "/" in c)     # only float32 formats were measured
    s = _setup(tiny_llama_dir, dtype="float32", kv_cache_dtype="float32", quantization="none")
    assert len(tuning.calls) == 1 and s.format.record()["mode"] == "table"   # all explicit: nothing measured
    assert s.config.kv_cache_dtype == "float32"


def test_off_means_the_tables(tiny_llama_dir, tuning, monkeypatch):
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    s = _setup(tiny_llama_dir)
    assert not tuning.calls and s.format.record() == {"mode": "table", "reason": "BATCHGEN_TUNE=off: the tables decide"}
    assert s.kernels is None


def test_tokens_are_unchanged_by_the_tuner(tiny_llama_dir, tuning, monkeypatch):
    from engine import LLM
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0, "lm_head:torch@float32": 2.0}   # elementwise c, head c
    opts = dict(kv_cache_memory=16 << 20, max_num_seqs=8, max_num_batched_tokens=256, speculative_config="off")
    prompts = ["the customer asked about a refund", "billing account password reset", "screen damage"] * 2
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tuned = LLM(tiny_llama_dir, **opts)
    assert tuned.info.format.record()["source"] == "measured" and tuned.config.dtype == "float32"
    assert tuned.model.model.layers[0].ops.kernels == {"elementwise": "c", "lm_head": "c", "attention": "c",
                                                       "linears": "c", "prefill_linears": "torch",
                                                       "int8_prompts": "int8"}
    monkeypatch.setenv("BATCHGEN_TUNE", "off")
    named = LLM(tiny_llama_dir, dtype="float32", quantization="none", kv_cache_dtype="float32", **opts)
    assert named.info.format.record()["mode"] == "table"
    assert ([o.token_ids for o in tuned.generate(prompts, params)] ==
            [o.token_ids for o in named.generate(prompts, params)])


def test_calibrate_retune_measures_again_and_prints_the_candidates(tiny_llama_dir, tuning):
    from click.testing import CliRunner

    from batchgen.report_cmd import calibrate_cmd
    tuning.times = {F32: 2.0, BF16: 1.0}
    for _ in range(2):
        res = CliRunner().invoke(calibrate_cmd, ["--retune", "--model", tiny_llama_dir])
        assert res.exit_code == 0, res.output
    assert len(tuning.calls) == 2                       # measured each time, the cached decision notwithstanding
    assert "chosen:      none weights, bfloat16 activations, bfloat16 KV cache" in res.output
    assert F32 in res.output and "score" in res.output and "kernels elementwise" in res.output


def test_a_pinned_config_repeats_the_recorded_format_without_measuring(tiny_llama_dir, tuning):
    """What an incremental, resumed or Ray run loads (pipeline.run.engine_format): the earlier engine's format."""
    tuning.times = {F32: 3.0, BF16: 1.0, F32_KV16: 2.0, "elementwise:c@bfloat16": 0.2,
                    "elementwise:torch@bfloat16": 0.1}
    first = _setup(tiny_llama_dir)
    choice = first.info().format_choice
    assert choice["dtype"] == "bfloat16" and choice["kernels"]["elementwise"] == "torch"
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0}                 # the machine would now choose otherwise
    again = _setup(tiny_llama_dir, **choice)
    assert len(tuning.calls) == 1 and again.info().format_choice == choice
    pinned = EngineConfig(tiny_llama_dir).pinned(choice)
    assert (pinned.quantization, pinned.dtype, pinned.kv_cache_dtype, pinned.kernels) == (
        choice["quantization"], "bfloat16", choice["kv_cache_dtype"], choice["kernels"])
    assert EngineConfig(tiny_llama_dir, dtype="float32").pinned(choice).dtype == "float32"     # explicit wins


def test_measured_steps_are_found_for_the_running_format(tiny_llama_dir, tuning, monkeypatch):
    """The plan's prediction scales to the tuner's timed steps of the format that runs, whichever fields were
    asked for by name; another machine's decision is not used."""
    tuning.times = {F32: 1.0, BF16: 3.0, F32_KV16: 2.0}
    s = _setup(tiny_llama_dir)
    ident = s.identity
    explicit = EngineConfig(tiny_llama_dir, dtype="bfloat16", kv_cache_memory=16 << 20)      # asked by name
    found = decision.measured_steps(explicit, ident, Format("none", "bfloat16", "bfloat16"))
    assert found is not None and set(found["shapes"]) == {sh.name for sh in probe.probe_shapes(256, 8, 32768)}
    assert set(found["shapes"].values()) == {3.0} and found["context"] == probe.DECODE_CONTEXT
    assert decision.measured_steps(explicit, ident, Format("none", "float32", "int8")) is None      # not measured
    monkeypatch.setattr(decision, "cpu_signature", lambda: "flags : another CPU")
    assert decision.measured_steps(explicit, ident, Format("none", "bfloat16", "bfloat16")) is None


def test_a_decision_measured_on_a_busy_machine_is_measured_again_when_quieter(tiny_llama_dir, tuning, monkeypatch):
    load = {"now": 9.0}
    monkeypatch.setattr(decision, "load_average", lambda: load["now"])
    monkeypatch.setattr(decision.os, "cpu_count", lambda: 2)
    first = _setup(tiny_llama_dir)
    assert first.format.record()["load_average"] == 9.0 and len(tuning.calls) == 1
    load["now"] = 6.0                                   # still busy: the cached decision stands
    assert _setup(tiny_llama_dir).format.record()["source"] == "cached" and len(tuning.calls) == 1
    assert _setup(tiny_llama_dir, tune=False).format.record()["source"] == "cached"     # planning never measures
    load["now"] = 0.5                                   # quiet: measured again, and that decision is kept
    assert _setup(tiny_llama_dir).format.record()["source"] == "measured" and len(tuning.calls) == 2
    assert _setup(tiny_llama_dir).format.record()["source"] == "cached" and len(tuning.calls) == 2


def test_a_far_slower_format_is_dropped_within_the_first_round():
    """After the first shape (the prefill) a format 2.5x slower there is timed no more, even before a round ends,
    so the budget repeats the contenders instead (the first round alone once ran out a 15 s budget)."""
    clock, ran = FakeClock(), []
    fmts = [Format("none", "float32", "float32"), Format("none", "bfloat16", "bfloat16")]
    m = probe.measure(_tasks(clock, {F32: 4.0, BF16: 1.0}, SHAPES, ran), clock, budget_s=1e9, max_rounds=2,
                      prune=probe._slow(fmts, SHAPES), early_prune=probe._slow(fmts, SHAPES, probe.EARLY_PRUNE_RATIO))
    assert m.pruned == [F32] and len(m.times[(F32, SHAPES[0].name)]) == 1
    assert all(not m.times[(F32, s.name)] for s in SHAPES[1:])
    assert all(len(m.times[(BF16, s.name)]) == 2 for s in SHAPES)
    scores = probe.format_scores(fmts, SHAPES, m)       # the live format scored on every shape, not the prefill's
    assert scores[fmts[1]] == pytest.approx(1.0) and scores[fmts[0]] == pytest.approx(4.0)
    d = decision.decide({}, fmts, {}, SHAPES, m, fmts[0], 2)
    assert d.format.name == BF16 and "(dropped)" in d.reason and d.candidates[0]["dropped"]
    m = probe.measure(_tasks(clock, {F32: 2.0, BF16: 1.0}, SHAPES), clock, budget_s=1e9, max_rounds=2,
                      early_prune=probe._slow(fmts, SHAPES, probe.EARLY_PRUNE_RATIO))     # 2x: not far enough
    assert not m.pruned and all(len(m.times[(F32, s.name)]) == 2 for s in SHAPES)


def test_the_prefill_shape_shrinks_with_the_model():
    """Every shape must be timed within the budget at 0.5-8B too: the prefill chunk holds at most PREFILL_OPS of
    linear work (gemma-3-270m's layers keep the full 1,024 tokens; Qwen2.5-1.5B's get under 100)."""
    from pathlib import Path

    from engine.models.config import ModelConfig
    qwen = ModelConfig.from_hf_dir(Path(__file__).parent.parent / "bench/models/qwen2.5-1.5b-instruct")
    # 28 layers x (QKV 1536 x 2048, output 1536 x 1536, gate-up-down 3 x 1536 x 8960)
    assert probe.layer_params(qwen) == 28 * (1536 * 2048 + 1536 * 1536 + 3 * 1536 * 8960)
    small = probe.probe_shapes(4096, 128, 32768, layer_params=100_000_000)
    qwen_15b = probe.probe_shapes(4096, 128, 32768, layer_params=probe.layer_params(qwen))
    huge = probe.probe_shapes(4096, 128, 32768, layer_params=7_000_000_000)
    assert small[0].rows == probe.PREFILL_MAX and 80 <= qwen_15b[0].rows < 100 and huge[0].rows == probe.PREFILL_MIN
    assert [s.rows for s in qwen_15b[1:]] == [s.rows for s in small[1:]]      # decode shapes are unchanged


def test_the_probe_budget_grows_with_the_model_up_to_its_cap():
    from engine.tuning.probe import BUDGET_MAX_SCALE, BUDGET_S, budget_for
    assert budget_for(0) == budget_for(4e8) == BUDGET_S                  # up to a 0.5B model's linears
    assert budget_for(1.2e9) == pytest.approx(3 * BUDGET_S)              # a 1.5B model's: three times
    assert budget_for(7e9) == BUDGET_MAX_SCALE * BUDGET_S                # an 8B model's: capped


def test_formats_whose_weights_do_not_fit_beside_the_others_are_not_measured(tiny_llama_dir, tuning, monkeypatch):
    """The candidates' models are loaded side by side: with room for the int8 model alone, only int8 formats are
    measured (the table's model first where it fits; then the smaller ones), and the reason names the others."""
    from engine.loader import load_model_config, resolve_model
    from engine.quant.policy import kernel_q8_isa
    if kernel_q8_isa() is None:
        pytest.skip("no int8 kernels in this build")
    mcfg = load_model_config(resolve_model(str(tiny_llama_dir)))
    fmts = [Format(*n.split("/")[:2], n.split("kv-")[1]) for n in (F32, BF16, F32_KV16, I8, I8_KV16)]
    i8 = probe.model_bytes(Format("int8", "float32", "bfloat16"), mcfg)
    avail = int(1.5 * i8 / probe.MEMORY_SHARE)
    assert probe.fitting(fmts, fmts[0], mcfg, None) == (fmts, [])
    assert probe.fitting(fmts, fmts[0], mcfg, avail) == (fmts[3:], fmts[:3])             # the float32 table: too big
    big = int((probe.model_bytes(fmts[1], mcfg) + i8) / probe.MEMORY_SHARE) + 16
    assert probe.fitting(fmts, fmts[1], mcfg, big) == ([fmts[1], *fmts[3:]], [fmts[0], fmts[2]])
    monkeypatch.setattr(decision, "available_memory_bytes", lambda: avail)
    tuning.times = {I8: 1.5, I8_KV16: 1.0}
    s = _setup(tiny_llama_dir)
    assert tuning.calls[0] == {I8, I8_KV16} and s.config.quantization == "int8"
    left_out = s.format.record()["reason"].split("; not measured: ")[1]
    assert "their weights do not fit" in left_out and all(n in left_out for n in (F32, BF16, F32_KV16))


def test_int8_prompt_rows_are_timed_at_prompt_sizes_and_scaled_to_the_step():
    """The probe's prefill shrinks with the model (64 rows at 4B); the int8 prompt rows' calls carry PROMPT_ROWS at
    least, and their difference enters the step's estimate scaled to its rows."""
    pre = probe.Shape("prefill 64", "prefill", 64, 0.5)
    assert probe.family_rows("int8_prompts", pre) == probe.PROMPT_ROWS
    assert probe.family_rows("elementwise", pre) == 64
    assert probe.family_rows("int8_prompts", probe.Shape("prefill 1024", "prefill", 1024, 0.5)) == 1024
    m = probe.Measurement(times={("int8_prompts:int8@float32", pre.name): [0.1],
                                 ("int8_prompts:bf16@float32", pre.name): [0.3]})
    out = decision._family("int8_prompts", ("int8", "bf16"), Format("int8", "float32", "bfloat16"),
                           {pre.name: 1.0}, [pre], m, num_layers=2)
    scale = 64 / probe.PROMPT_ROWS
    assert out["score_ms"]["bf16"] == pytest.approx(1e3 * (1.0 + 2 * 0.2 * scale), rel=1e-6)
    assert out["chosen"] == "int8"
