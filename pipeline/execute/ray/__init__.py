"""Step 3 on Ray (``batchgen submit --ray``): ``driver`` (this process: starts the replicas, hands them work,
takes their results), ``replica`` (the body of one Ray actor: one engine), ``assign`` (which replica computes
which planned requests; no Ray). Ray is an optional extra: nothing in this package imports ``ray`` at module
level, so importing ``pipeline.execute.ray.*`` works without it."""
