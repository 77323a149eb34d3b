"""batchgen pipeline: job files, datasets in, prefix-aware plan, engine, Parquet out."""
