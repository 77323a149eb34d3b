"""Measured defaults: on a model's first load on a machine, the ways to run it here are timed on its real shapes
and the fastest within the quality bar is cached and used (candidates.py, probe.py, decision.py;
format_decision.py: the format an engine computes in, as ``LLM``'s tuning phase decides it;
docs/guide/engine-options.md says what ``auto`` means)."""
