"""Glue to other libraries: data-parallel training around `MoELayer`s (here) and Hugging Face
transformers models (`moe_ep.integrations.transformers.replace_moe_blocks`)."""

from .data_parallel import ddp_ignored_names, expert_parameters, scale_expert_gradients, sync_gradients

__all__ = ["ddp_ignored_names", "expert_parameters", "scale_expert_gradients", "sync_gradients"]
