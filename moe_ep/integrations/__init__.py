"""Glue to other libraries: Hugging Face transformers models and data-parallel training."""

from .data_parallel import ddp_ignored_names, expert_parameters, scale_expert_gradients, sync_gradients

__all__ = ["ddp_ignored_names", "expert_parameters", "scale_expert_gradients", "sync_gradients"]
