"""Stage 1: reading inputs and writing outputs: tables (Parquet, `datasets`, URIs), OpenAI Batch JSONL, paths."""
