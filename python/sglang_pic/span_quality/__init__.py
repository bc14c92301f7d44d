"""Span quality: how far answers move when each document is prefilled as a span instead of with dense attention.

The tasks (tasks.py, a module per family) write items with gold answers; prompts.py renders and tokenizes them as
the server does; modes.py names the ways a prompt is served; runner.py runs each mode through its own Engine;
scoring.py compares the modes with dense attention. check.py, run as `python -m sglang_pic.check_span_quality`, is
the quick run on a user's model and recommends a setting (recommend.py); benchmark/bench_span_quality.py is the
full-size run.
"""
