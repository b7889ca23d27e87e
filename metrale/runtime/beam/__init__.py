"""Beam search (BeamGenerate): the search itself, its parameters, and the call over the block pool."""
