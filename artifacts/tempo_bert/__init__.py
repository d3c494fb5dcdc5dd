"""tempo_bert experiment (driver: run.py)."""

from ..experiment import Experiment

EXPERIMENT = Experiment("tempo_bert")
