"""What turns a job's requests into prompts: ``JobPrompts`` holds the renderer, the parameter sets and the distinct
prompt tails of one job while it runs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine import BatchgenError, SamplingParams
from pipeline.job.job_file import Job
from pipeline.job.prompts import PromptRenderer, RowError
from pipeline.job.structured_output import output_fields, written_schema


@dataclass
class JobPrompts:
    """What turns a job's ``rows.RowRequest`` into token ids and parameters: the renderer, the parameter sets (0: the
    job's own; more for rows whose OpenAI batch body overrides the generation) and the distinct prompt tails."""
    job: Job
    renderer: PromptRenderer
    fingerprint: str                  # of everything but the row that determines a result (``prompts.row_key``)
    params: SamplingParams            # the job's own
    max_model_len: int
    param_sets: list = field(default_factory=list)     # params id -> SamplingParams
    tails: dict = field(default_factory=dict)          # tail token ids -> tail id
    tail_ids: list = field(default_factory=list)       # tail id -> tail token ids
    _param_index: dict = field(default_factory=dict)
    fields: list = field(default_factory=list)         # typed output columns of the job's JSON schema (structured)

    def __post_init__(self) -> None:
        self.param_sets = [self.params]
        self._param_index = {(): 0}
        self.fields = output_fields(written_schema(self.job.generation))

    def unconstrained_index(self, params: int) -> int:
        """The params id of ``params`` without its structured outputs: map_reduce's parts are prose, only the
        final reduce answers in the schema."""
        p = self.param_sets[params]
        if p.structured_outputs is None:
            return params
        key = ("unconstrained", params)
        i = self._param_index.get(key)
        if i is None:
            i = self._param_index[key] = len(self.param_sets)
            self.param_sets.append(dataclasses.replace(p, structured_outputs=None))
        return i

    def params_index(self, overrides: tuple) -> int:
        """The params id of a row whose request overrides the job's generation (OpenAI batch bodies)."""
        try:
            i = self._param_index.get(overrides)
        except TypeError:          # a list or object where a number or string belongs (max_tokens: [])
            bad = next(k for k, v in overrides if not _hashable(v))
            raise RowError(f"body: {bad}: {dict(overrides)[bad]!r} is not a valid value") from None
        if i is None:
            p = self._sampling_params(overrides)
            i = self._param_index[overrides] = len(self.param_sets)
            self.param_sets.append(p)
        return i

    def _sampling_params(self, overrides: tuple) -> SamplingParams:
        try:
            return SamplingParams(**{**self.job.generation, **dict(overrides)})
        except (BatchgenError, ValueError) as e:
            raise RowError(f"body: {e}") from None
        except TypeError as e:      # a value of the wrong type: the message names no field, so name them here
            given = ", ".join(f"{k}={v!r}" for k, v in overrides)
            raise RowError(f"body: {given}: {e}") from None

    def tail_index(self, tail: tuple[int, ...]) -> int:
        i = self.tails.get(tail)
        if i is None:
            i = self.tails[tail] = len(self.tail_ids)
            self.tail_ids.append(tail)
        return i


def _hashable(v) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


__all__ = ["JobPrompts"]
