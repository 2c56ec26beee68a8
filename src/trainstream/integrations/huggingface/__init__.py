"""Hugging Face integration: transformers' Trainer and models over the TrainStream engine."""

from .loading import load_model as load_model
from .trainer import TrainStreamTrainer as TrainStreamTrainer
from .wrap import wrap_hf as wrap_hf
