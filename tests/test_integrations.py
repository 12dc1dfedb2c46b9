"""`replace_moe_blocks`: tiny random Hugging Face MoE models give the same outputs and gradients after
the swap, at expert parallelism 1 and 2 (each rank feeding its own batch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

from moe_ep.integrations import sync_gradients  # noqa: E402
from moe_ep.integrations.transformers import hf_state_dict, replace_moe_blocks  # noqa: E402

VOCAB = 61
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, attn_implementation="eager")


def _tiny_model(family: str) -> torch.nn.Module:
    """A 2-layer model of `family` with a fixed random init (the same on every rank)."""
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2, **_COMMON)
        model_class = transformers.MixtralForCausalLM
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(moe_intermediate_size=16, intermediate_size=48, num_experts=4,
                                             shared_expert_intermediate_size=24, num_experts_per_tok=2,
                                             norm_topk_prob=False, **_COMMON)
        model_class = transformers.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=16, intermediate_size=48, num_experts=4,
                                             num_experts_per_tok=2, norm_topk_prob=True, head_dim=8, **_COMMON)
        model_class = transformers.Qwen3MoeForCausalLM
    else:
        config = transformers.DeepseekV3Config(
            moe_intermediate_size=16, intermediate_size=48, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5,
            **{**_COMMON, "num_key_value_heads": 4})
        model_class = transformers.DeepseekV3ForCausalLM
    torch.manual_seed(0)
    model = model_class(config)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):  # negative and positive, so selection depends on it
            buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


def _hf_name(model: torch.nn.Module, name: str) -> str:
    """A swapped model's parameter name under the original model's naming."""
    block, sep, key = name.partition(".moe.")
    return f"{block}.{model.get_submodule(block).hf_key(key)}" if sep else name


def _check_swap(rank: int, world: int, family: str) -> None:
    reference = _tiny_model(family)
    swapped = copy.deepcopy(reference)
    assert replace_moe_blocks(swapped) == (1 if family == "deepseek_v3" else 2)
    torch.manual_seed(100 + rank)
    ids = torch.randint(0, VOCAB, (2, 12))
    outputs = []
    for model in (reference, swapped):
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        out.loss.backward()
        outputs.append(out)
    expected, got = outputs
    close = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.logits, expected.logits, **close)
    torch.testing.assert_close(got.loss, expected.loss, **close)
    if expected.aux_loss is not None:
        torch.testing.assert_close(got.aux_loss, expected.aux_loss, **close)
    assert len(got.router_logits) == len(expected.router_logits) > 0
    for got_logits, expected_logits in zip(got.router_logits, expected.router_logits):
        torch.testing.assert_close(got_logits.float(), expected_logits.float(), **close)

    reference_params = dict(reference.named_parameters())
    for name, param in swapped.named_parameters():
        want = reference_params[_hf_name(swapped, name)].grad
        if ".moe.experts." in name:  # this rank's shard, fed by every rank's tokens
            dist.all_reduce(want)
            begin = rank * param.size(0)
            want = want[begin:begin + param.size(0)]
        torch.testing.assert_close(param.grad, want.to(param.dtype), **close, msg=lambda m: f"{name}: {m}")

    exported = hf_state_dict(swapped)
    reference_state = reference.state_dict()
    assert exported.keys() == reference_state.keys()
    for key, value in reference_state.items():
        torch.testing.assert_close(exported[key].to(value.dtype), value, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3"])
def test_swap_matches_reference(dist_pool, family: str, world: int) -> None:
    dist_pool(world).run(_check_swap, family)


def _check_data_parallel(rank: int, world: int) -> None:
    """Each rank's half of a batch through the swapped model, then `sync_gradients`: the gradients of
    the whole batch through the unswapped model (replicated ones everywhere, each expert on its owner)."""
    reference = _tiny_model("deepseek_v3")
    swapped = copy.deepcopy(reference)
    replace_moe_blocks(swapped)
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (2 * world, 12))
    reference(input_ids=ids, labels=ids).loss.backward()
    mine = ids.chunk(world)[rank]
    swapped(input_ids=mine, labels=mine).loss.backward()
    sync_gradients(swapped)
    reference_params = dict(reference.named_parameters())
    for name, param in swapped.named_parameters():
        want = reference_params[_hf_name(swapped, name)].grad
        if ".moe.experts." in name:
            want = want[rank * param.size(0):(rank + 1) * param.size(0)]
        torch.testing.assert_close(param.grad, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_sync_gradients_matches_whole_batch(dist_pool) -> None:
    dist_pool(2).run(_check_data_parallel)
