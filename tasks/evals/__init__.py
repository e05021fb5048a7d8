"""Kiln evals work: plain functions, no orchestration."""
