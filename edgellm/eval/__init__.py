"""Accuracy evaluation: quality gap vs a reference, per-layer attribution, structured tasks, release gate."""
