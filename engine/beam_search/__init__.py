"""Beam search: the offline API (`BeamSearchParams` in, `BeamSearchOutput` out) and, in
`engine.beam_search.steps`, the part of the engine's step that runs the searches."""

from engine.beam_search.offline import BeamSearchOutput, BeamSearchParams, BeamSearchSequence

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence"]
