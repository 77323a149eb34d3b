"""One job while it runs: its record (``JobRun``): the counts the manifest, the history and ``batchgen submit``'s
summary report, and the results waiting to be committed."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine import EngineInfo, RequestOutput
from pipeline.job.job_file import Job
from pipeline.job.job_prompts import JobPrompts
from pipeline.job.prompts import PromptRenderer, fingerprint
from pipeline.job.rows import ResultRow, RowRequest
from pipeline.job.state import RunState
from pipeline.job.structured_output import JSON_KINDS, json_error
from pipeline.prepare.long_docs import LongDocs


@dataclass
class JobRun:
    """One job's record of this run; ``take`` counts a finished request and queues its result for ``commit``."""
    job: Job
    state: RunState
    prompts: JobPrompts
    long_docs: LongDocs               # on_too_long: map_reduce
    pending: list[ResultRow] = field(default_factory=list)     # results not committed yet
    # input and reuse (``prepare``)
    num_rows: int = 0
    reused: int = 0
    changed: int = 0
    spill_rows: int = 0
    keys_digest: str = ""
    planned_copies: int = 0                    # rows equal to another request: take its result (prepare.dedup) ...
    planned_copy_tokens: int = 0               # ... and their prompt tokens (not computed)
    # computed this run
    computed: int = 0
    row_errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    draft_tokens: int = 0                      # speculation: drafts proposed for this job's requests ...
    accepted_tokens: int = 0                   # ... and accepted
    spec_steps: int = 0                        # request-steps that verified drafts (mean accepted length)
    json_rows: int = 0                         # structured outputs: rows checked against a JSON schema ...
    json_valid: int = 0                        # ... and valid
    forced_tokens: int = 0                     # tokens the grammar forced (no sampling)
    masks_applied: int = 0                     # steps whose unconstrained choice was rejected: a full mask
    mask_s: float = 0.0                        # time computing / applying masks
    dedup_rows: int = 0                        # rows that took an identical request's result (not computed) ...
    dedup_prompt_tokens: int = 0               # ... their prompt tokens and output tokens: what they saved
    dedup_output_tokens: int = 0
    # predicted (planner, costmodel.predict)
    predicted_cached: int = 0
    planned_prompt_tokens: int = 0
    predicted_engine_s: float | None = None    # this job's requests as if run alone
    # assembled (``assemble``)
    up_to_date: bool = False
    manifest: dict | None = None
    deleted_kept: int = 0                      # rows no longer in the input, kept (output.keep_deleted_rows)
    deleted_dropped: int = 0                   # ... dropped from the output

    def take(self, key: str, out: RequestOutput, params: int = 0, copy: bool = False) -> ResultRow:
        """A finished request (under params id ``params``): a row's result, a part of a long row's (map_reduce),
        or a long row's last. A result asked for as JSON is checked against its schema (``json_error``).
        ``copy``: the result of an identical request computed for another row (prepare.dedup): the row's, counted
        as saved, not as computed tokens."""
        row = ResultRow.from_output(key, out)
        if copy:
            self.dedup_rows += 1
            self.dedup_prompt_tokens += row.prompt_tokens
            self.dedup_output_tokens += row.output_tokens
            self._finish(row, params)
            return row
        m = out.metrics
        self.prompt_tokens += row.prompt_tokens
        self.cached_tokens += row.cached_tokens
        self.output_tokens += row.output_tokens
        self.draft_tokens += m.num_draft_tokens
        self.accepted_tokens += m.num_accepted_tokens
        self.spec_steps += m.num_spec_steps
        self.forced_tokens += m.num_forced_tokens
        self.masks_applied += m.num_masks_applied
        self.mask_s += m.mask_time_s
        self._finish(row, params)
        return row

    def _finish(self, row: ResultRow, params: int) -> None:
        if self.long_docs.finish(row) != "part":        # a part is committed, but is not a row
            self.computed += 1
            self.row_errors += row.error is not None
            sp = self.prompts.param_sets[params]
            so = sp.structured_outputs
            if so is not None and so.kind in JSON_KINDS and row.error is None:
                fields = self.prompts.fields if so == self.prompts.params.structured_outputs else ()
                row.json_error = json_error(row.summary, row.finish_reason, so, fields, sp.max_tokens)
                self.json_rows += 1
                self.json_valid += row.json_error is None
        self.pending.append(row)

    def row_error(self, key: str, message: str) -> None:
        """A row that cannot be computed (``prepare``): its error is its result."""
        self.row_errors += 1
        self.pending.append(ResultRow.failed(key, message))

    def reduce_requests(self, job_index: int) -> list[RowRequest]:
        """The next reduce level's requests of this job's long rows; long rows that failed get their error row."""
        requests, errors = self.long_docs.next_requests(job_index, self.state)
        for row in errors:
            self.pending.append(row)
            self.computed += 1
            self.row_errors += 1
        return requests

    def commit(self) -> None:
        if self.pending:
            rows, self.pending = self.pending, []
            self.state.commit(rows)


def new_job_run(job: Job, state: RunState, tokenizer, info: EngineInfo) -> JobRun:
    params = job.sampling_params
    fp = fingerprint(info.identity, dataclasses.asdict(params), job.prompt.on_too_long, job.prompt.chat_template)
    prompts = JobPrompts(job, PromptRenderer(job.prompt, tokenizer), fp, params, info.config.max_model_len)
    return JobRun(job=job, state=state, prompts=prompts, long_docs=LongDocs(prompts, job.prompt.parsed_reduce))


__all__ = ["JobRun", "new_job_run"]
