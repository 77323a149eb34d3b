"""Stage 4: preparing each job's input: row keys, reuse, spill files, long documents (map_reduce)."""
