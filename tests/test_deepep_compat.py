"""A program written against DeepEP V1's API runs unchanged with `import moe_ep as deep_ep`."""

from __future__ import annotations

import torch
import torch.distributed as dist

import moe_ep as deep_ep
from reference import combine_reference, expert_output, make_inputs


def _deepep_style_program(rank: int, world: int) -> None:
    group = dist.group.WORLD
    hidden, num_experts, num_topk = 256, 4 * world, 3
    inputs = make_inputs(8, world, [24, 16, 9, 30][:world], hidden, num_experts, num_topk)
    x, topk_idx, topk_weights = inputs[rank].x, inputs[rank].topk_idx, inputs[rank].topk_weights

    # Buffer sizing exactly as DeepEP's README does it.
    deep_ep.Buffer.set_num_sms(24)
    hidden_bytes = hidden * max(x.element_size(), 2)
    num_nvl_bytes, num_rdma_bytes = 0, 0
    for config in (deep_ep.Buffer.get_dispatch_config(group.size()), deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    assert num_nvl_bytes > 0 and num_rdma_bytes == 0
    buffer = deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes)

    previous_event = deep_ep.Buffer.capture()
    num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event = \
        buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event, async_finish=True,
                                   allocate_on_comm_stream=True)
    recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event = \
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
                        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                        num_tokens_per_expert=num_tokens_per_expert, previous_event=event, async_finish=True,
                        allocate_on_comm_stream=True)
    event.current_stream_wait()
    assert recv_topk_idx.dtype == deep_ep.topk_idx_t and sum(num_recv_tokens_per_expert_list) == int(
        (recv_topk_idx >= 0).sum())
    rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, _, send_head = handle
    assert rank_prefix_matrix.shape == (world, world) and send_head.shape == (x.size(0), world)

    with buffer.combine(expert_output(recv_x, rank), handle, async_finish=True)[2]:
        pass  # EventOverlap works as a context manager
    combined_x, _, event = buffer.combine(expert_output(recv_x, rank), handle, async_finish=True)
    event.current_stream_wait()
    assert torch.equal(combined_x, combine_reference(inputs, rank, num_experts)[0])

    # Low-latency mode as DeepEP's README sets it up.
    num_max_dispatch_tokens_per_rank = 32
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden,
                                                                   group.size(), num_experts)
    ll_buffer = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True,
                               num_qps_per_rank=num_experts // group.size(), allow_nvlink_for_low_latency_mode=True,
                               explicitly_destroy=True)
    ll_buffer.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)
    recv_hidden_states, recv_expert_count, handle, event, hook = ll_buffer.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, async_finish=False, return_recv_hook=True)
    hook()
    fp8_data, scales = recv_hidden_states
    assert fp8_data.dtype == torch.float8_e4m3fn and recv_expert_count.dtype == torch.int32
    src_info, layout_range, max_tokens, handle_hidden, handle_experts = handle
    assert (max_tokens, handle_hidden, handle_experts) == (num_max_dispatch_tokens_per_rank, hidden, num_experts)
    expert_out = deep_ep.ops.fp8.per_token_cast_back(fp8_data, scales)
    combined_x, event, hook = ll_buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                           return_recv_hook=True)
    hook()
    assert combined_x.shape == x.shape and combined_x.dtype == torch.bfloat16
    seen = deep_ep.ops.fp8.per_token_cast_back(*deep_ep.ops.fp8.per_token_cast_to_fp8(x))
    weight_sum = torch.where(topk_idx >= 0, topk_weights, 0.0).sum(1, keepdim=True)
    torch.testing.assert_close(combined_x.float(), weight_sum * seen.float(), rtol=2e-2, atol=1e-2)
    ll_buffer.destroy()


def test_deepep_program_runs_unchanged(dist_pool) -> None:
    dist_pool(3).run(_deepep_style_program)
