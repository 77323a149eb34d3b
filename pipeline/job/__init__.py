"""Stage 2: the job file and what it means per row: the job spec, prompts, structured output columns, result
rows, run state."""
