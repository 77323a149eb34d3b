"""Structured outputs: generation constrained to a JSON Schema, a regex, a choice or a grammar (vLLM's names).

``StructuredOutputsParams`` is what a request asks for (``SamplingParams(structured_outputs=...)``);
``check_structured`` refuses a request the engine cannot honour before any compute, naming the keyword.
"""
from engine.structured.params import StructuredOutputError, StructuredOutputsParams, check_structured

__all__ = ["StructuredOutputsParams", "StructuredOutputError", "check_structured"]
