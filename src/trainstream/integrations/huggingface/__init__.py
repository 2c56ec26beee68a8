"""Hugging Face integration: transformers' Trainer and models over the TrainStream engine."""

from .trainer import TrainStreamTrainer as TrainStreamTrainer
from .wrap import wrap_hf as wrap_hf
