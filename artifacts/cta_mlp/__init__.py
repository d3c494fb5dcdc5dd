"""cta_mlp experiment (driver: run.py)."""

from ..experiment import Experiment

EXPERIMENT = Experiment("cta_mlp")
