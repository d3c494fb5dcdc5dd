"""tempo_llama experiment (driver: run.py)."""

from ..experiment import Experiment

EXPERIMENT = Experiment("tempo_llama")
