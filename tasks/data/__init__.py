"""Kiln data work: plain functions, no orchestration."""
