"""Launching: the cluster's shape, the launchers (local, torchrun, Slurm, Kubernetes) behind one
interface, the torchrun worker entry point, and the record of which host ran which rank."""
