"""Stage 5: computing a planned batch: in this process (execution, feeder) or on Ray replicas (ray/)."""
