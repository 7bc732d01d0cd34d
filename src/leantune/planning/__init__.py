"""Knowing before running: a step traced on fake tensors, per-mode plans, the mode and batch that fit."""
