"""pipeline.execute.execution: the local engine and the Ray driver implement the one Execution protocol (no Ray
needed)."""
from __future__ import annotations

import inspect

import pytest

from pipeline.execute.execution import Execution, LocalExecution
from pipeline.execute.ray.driver import RayExecution

MEMBERS = [n for n in vars(Execution) if not n.startswith("_")]


@pytest.mark.parametrize("cls", [LocalExecution, RayExecution])
def test_implements_execution(cls):
    assert set(MEMBERS) >= {"start", "begin", "done", "poll", "steps", "close", "engine_info", "summary"}
    for name in MEMBERS:
        theirs, ours = getattr(cls, name, None), getattr(Execution, name)
        assert theirs is not None, f"{cls.__name__} lacks {name}"
        if callable(ours):
            assert inspect.signature(theirs).parameters.keys() == inspect.signature(ours).parameters.keys()
        assert isinstance(theirs, property) == isinstance(ours, property)
