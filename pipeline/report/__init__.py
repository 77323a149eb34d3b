"""``batchgen report``: a run's traces (pipeline.run.trace) turned into numbers and a diagnosis (analysis.py) and a
self-contained HTML page (html.py).

    summary = analyze(read_run(run_dir))          # plain dict of numbers; the HTML and the tests read it
    render_report([run_dir], "report.html")       # one run; two run dirs -> side-by-side comparison
"""
from pipeline.report.analysis import analyze, diagnose, roofline, shape_warnings
from pipeline.report.html import render_report

__all__ = ["analyze", "diagnose", "render_report", "roofline", "shape_warnings"]
