"""``batchgen serve``: OpenAI's Batch API (Files + Batches) over batchgen runs.

    store.py    files and batches in SQLite, bodies under the data dir
    worker.py   validates queued batches, runs them as ``batchgen submit`` children, writes output / error files
    app.py      the HTTP routes (FastAPI), authentication and limits
"""
