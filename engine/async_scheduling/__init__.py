"""Async scheduling: the next step is scheduled and its batch built while the model runs the
current one, and a step's outputs are made while the model runs the next (see step_pipeline)."""

from engine.async_scheduling.step_pipeline import AppliedStep, PlannedStep, StepPipeline

__all__ = ["AppliedStep", "PlannedStep", "StepPipeline"]
