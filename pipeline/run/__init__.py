"""Orchestration: the runner (prepare, plan, execute, assemble), validation, admission, trace, history."""
