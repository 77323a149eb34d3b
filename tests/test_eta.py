"""The progress bar's ETA from the plan (pipeline/run/eta.py): each position's share of the predicted seconds,
corrected by the pace achieved."""
import types

import numpy as np
import pytest

from pipeline.run.eta import PlanEta


def _plan(prompt_len, cached):
    return types.SimpleNamespace(prompt_len=np.array(prompt_len), cached=np.array(cached),
                                 num_requests=len(prompt_len))


def test_shares_follow_computed_prompt_tokens_and_output_budget():
    plan = _plan([1000, 1000, 100], [0, 900, 0])              # computed: 1000, 100, 100
    pred = types.SimpleNamespace(prefill_s=12.0, decode_s=6.0)
    eta = PlanEta.of(plan, pred, np.array([10, 10, 40]), t_start=0.0)
    assert [eta.seconds_at(p) for p in range(3)] == pytest.approx([10 + 1, 1 + 1, 1 + 4])
    assert eta.total == pytest.approx(18.0)


def _eta(seconds, t_start):
    """An ETA whose positions take ``seconds`` (as prompt tokens at 1 s each)."""
    n = len(seconds)
    return PlanEta(np.array(seconds), np.zeros(n), np.zeros(n), 1.0, 0.0, t_start)


def test_before_any_row_the_prediction_less_elapsed_then_the_achieved_pace():
    eta = _eta([2, 2, 4, 8], t_start=100.0)
    assert eta.left_s(103.0) == pytest.approx(13.0)
    eta.finished(2)                                  # 4 of 16 predicted seconds done, in 8 s: half the pace
    assert eta.left_s(108.0) == pytest.approx(12.0 * 2)
    eta.finished(0)
    eta.finished(1)
    eta.finished(3)
    assert eta.left_s(130.0) == 0.0
    assert _eta([3725], 0.0).text(0.0) == "ETA 1h02m"
    assert _eta([65], 0.0).text(0.0) == "ETA 1m05s"


def test_no_prediction_no_eta():
    assert PlanEta.of(_plan([5], [0]), None, np.array([4]), 0.0) is None


def test_a_run_shows_the_plans_time_left(tmp_path, make_docs_dataset, fake_llm_factory, monkeypatch):
    """Every progress update of a priced run carries the plan's ETA, falling to zero at the end."""
    from costmodel.predict import Prediction
    from pipeline.run import runner
    from tests.test_pipeline import run, write_job
    # the test double has no roofline to price with: a prediction as a calibrated engine's
    monkeypatch.setattr(runner.Runner, "_predict", lambda *a: Prediction(30.0, 20.0, 10.0, 12, 96))
    shown = []
    orig = runner._Progress.postfix
    monkeypatch.setattr(runner._Progress, "postfix", lambda self: shown.append((orig(self), self.eta)) or shown[-1][0])
    run([write_job(tmp_path, "eta", make_docs_dataset(n=12))], fake_llm_factory)
    assert len(shown) == 12 and all(text.endswith("(plan)") and "ETA " in text for text, _ in shown)
    eta = shown[-1][1]
    assert eta.done_s == pytest.approx(eta.total) == pytest.approx(30.0)
