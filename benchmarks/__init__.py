"""Serving benchmarks for Sluice and its peers (vLLM, llama.cpp): `python -m benchmarks.bench`,
`python -m benchmarks.plot`, `python -m benchmarks.compare`. Never run as timed tests."""
