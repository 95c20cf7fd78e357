"""Distillation of draft models for a target."""
