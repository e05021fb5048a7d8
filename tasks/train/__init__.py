"""Kiln train work: plain functions, no orchestration."""
