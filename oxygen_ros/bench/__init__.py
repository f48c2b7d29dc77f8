"""Benchmarks: scheduling modes, fleets, real-time chunking, questions, energy."""
