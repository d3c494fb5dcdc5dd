"""tempo_layer experiment (driver: run.py)."""

from ..experiment import Experiment

EXPERIMENT = Experiment("tempo_layer")
