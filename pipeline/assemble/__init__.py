"""Stage 6: results to the output file and manifest, and the run's closing summary."""
