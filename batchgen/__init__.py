"""The ``batchgen`` command line: the click group and its entry point (cli.py), one module per command group
(bench_cmd, report_cmd, schedule_cmd). The top layer: it imports pipeline/, bench/, costmodel/ and engine/;
nothing imports it."""
