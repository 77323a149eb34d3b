"""Structured outputs: generation constrained to a JSON Schema, a regex, a choice or a grammar (vLLM's names).

``StructuredOutputsParams`` is what a request asks for (``SamplingParams(structured_outputs=...)``);
``check_structured`` refuses a request the engine cannot honour before any compute, naming the keyword.
The grammar library (backend.py, llguidance_backend.py) and each request's matcher (state.py) live here; applying
a grammar to logits and samples is engine.sample.constrain.
"""
from engine.structured.params import StructuredOutputError, StructuredOutputsParams, check_structured

__all__ = ["StructuredOutputsParams", "StructuredOutputError", "check_structured"]
