"""Helpers of the workers with verl's import paths (`verl.workers.utils.losses`)."""
