"""Test-wide settings that must precede the first torch import."""

import os

# Spinning OpenMP workers make torch ~10x slower on a shared 2-core machine (see flows/cli.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
