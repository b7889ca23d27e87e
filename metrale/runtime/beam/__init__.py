"""Beam search (BeamGenerate): the search itself, its parameters, and the runner over the KV pool."""
