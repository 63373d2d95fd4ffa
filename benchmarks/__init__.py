"""Benchmarks of purinec against its peers; see benchmarks/README.md."""
