"""The benchmarks behind the speed numbers: run `python -m bench --help` from the repository root
(bench/__main__.py says which file measures what)."""
