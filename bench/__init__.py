"""Benchmarks: speed, memory and compile checks, each a module run from the
repository root (`python -m bench.attention`); results in `RESULTS.md` and
`results/`."""
