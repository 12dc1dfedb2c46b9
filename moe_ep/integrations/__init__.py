"""Glue to other libraries: Hugging Face transformers models and data-parallel training."""

from .data_parallel import expert_parameters, sync_gradients

__all__ = ["expert_parameters", "sync_gradients"]
