"""`python -m sglang_pic.check_span_quality`: the documented command of the quick span-quality check, whose code is
sglang_pic/span_quality/check.py."""

from sglang_pic.span_quality.check import main

if __name__ == "__main__":
    main()
