"""Kiln scaling work: plain functions, no orchestration."""
