"""The benchmarks, grouped by what they measure, and their shared harness (`bench/harness.py`); none of it is
part of the installed library. bench/README.md says how to run them."""
