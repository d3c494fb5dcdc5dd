"""mist_vs_megatron experiment (driver: run.py)."""

from ..experiment import Experiment

EXPERIMENT = Experiment("mist_vs_megatron")
