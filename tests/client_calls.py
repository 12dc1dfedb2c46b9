"""The DeepEP call sequences of vLLM and SGLang, replayed with the arguments those clients pass.

Neither client runs without a GPU, so tests/test_deep_ep_clients.py drives these replays against
moe_ep on CPU ranks. Each function follows one client function call for call, with the same
arguments (docs/clients.md lists them, with the versions read); only the client's surroundings are
left out: its quantization kernels, its experts, its micro-batch overlap (off by default in both).
`deep_ep` is passed in: the module the client would have imported.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Optional

import torch
import torch.distributed as dist

# vLLM: the default of VLLM_DEEPEP_BUFFER_SIZE_MB, the SMs its managers give DeepEP, and the world sizes
# for which DeepEPHTPrepareAndFinalize asks DeepEP for a tuned Config (None otherwise).
VLLM_DEEPEP_BUFFER_SIZE_MB = 1024
VLLM_NUM_SMS = 20
VLLM_HT_RANK_CONFIGS = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


def vllm_ht_buffer(deep_ep: ModuleType, cpu_group: dist.ProcessGroup) -> object:
    """vLLM DeepEPHTAll2AllManager: `_make_all2all_kwargs` (one node) and `get_handle`, then `set_num_sms`."""
    kwargs = dict(group=cpu_group, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024, num_rdma_bytes=0,
                  low_latency_mode=False, num_qps_per_rank=1, explicitly_destroy=True)
    buffer = deep_ep.Buffer(**kwargs)
    deep_ep.Buffer.set_num_sms(VLLM_NUM_SMS)
    return buffer


def vllm_ht_prepare(deep_ep: ModuleType, buffer: object, tokens: torch.Tensor, token_scales: Optional[torch.Tensor],
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, rank_expert_offset: int,
                    num_dispatchers: int) -> tuple:
    """vLLM DeepEPHTPrepareAndFinalize `_do_dispatch` and `_receiver`, without micro-batching.

    Returns `(expert_x, expert_x_scale, expert_num_tokens_per_expert_list, expert_topk_ids (global ids),
    expert_topk_weights, handle)`."""
    previous_event = None  # dbo_get_previous_event(buffer.capture) gives None without micro-batches
    (num_tokens_per_rank, num_tokens_per_rdma_rank, dispatch_expert_num_tokens, is_token_in_rank,
     event) = buffer.get_dispatch_layout(topk_idx=topk_ids, num_experts=num_experts, previous_event=previous_event,
                                         async_finish=False, allocate_on_comm_stream=False)
    token_data = tokens if token_scales is None else (tokens, token_scales)
    config = deep_ep.Buffer.get_dispatch_config(num_dispatchers) if num_dispatchers in VLLM_HT_RANK_CONFIGS else None
    (token_data, expert_topk_ids, expert_topk_weights, expert_num_tokens_per_expert_list, handle,
     event) = buffer.dispatch(x=token_data, handle=None, num_tokens_per_rank=num_tokens_per_rank,
                              num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
                              num_tokens_per_expert=dispatch_expert_num_tokens, topk_idx=topk_ids,
                              topk_weights=topk_weights, expert_alignment=1, config=config,
                              previous_event=previous_event, async_finish=True, allocate_on_comm_stream=False)
    # _receiver
    if event.event is not None:
        event.current_stream_wait()
    expert_x, expert_x_scale = token_data if token_scales is not None else (token_data, None)
    expert_topk_ids = torch.where(expert_topk_ids == -1, num_experts - 1 if rank_expert_offset == 0 else 0,
                                  expert_topk_ids + rank_expert_offset)
    return expert_x, expert_x_scale, expert_num_tokens_per_expert_list, expert_topk_ids, expert_topk_weights, handle


def vllm_ht_finalize(deep_ep: ModuleType, buffer: object, handle: object, fused_expert_output: torch.Tensor,
                     output: torch.Tensor, num_dispatchers: int, do_async: bool) -> None:
    """vLLM DeepEPHTPrepareAndFinalize `_finalize` (weights already applied by the experts) and its receiver."""
    previous_event = None
    assert fused_expert_output.dtype == torch.bfloat16
    config = deep_ep.Buffer.get_combine_config(num_dispatchers) if num_dispatchers in VLLM_HT_RANK_CONFIGS else None
    combined_x, _, event = buffer.combine(x=fused_expert_output, handle=handle, topk_weights=None, config=config,
                                          previous_event=previous_event, async_finish=do_async,
                                          allocate_on_comm_stream=False)
    if do_async and event.event is not None:
        event.current_stream_wait()
    output.copy_(combined_x, non_blocking=True)


def vllm_ll_buffer(deep_ep: ModuleType, cpu_group: dist.ProcessGroup, max_num_tokens_per_dp_rank: int,
                   token_hidden_size: int, num_ep_ranks: int, num_global_experts: int, num_local_experts: int,
                   enable_fault_tolerance: bool = False) -> object:
    """vLLM DeepEPLLAll2AllManager: `_make_all2all_kwargs` and `get_handle`."""
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(
        num_max_dispatch_tokens_per_rank=max_num_tokens_per_dp_rank, hidden=token_hidden_size,
        num_ranks=num_ep_ranks, num_experts=num_global_experts)
    kwargs = dict(group=cpu_group, num_nvl_bytes=VLLM_DEEPEP_BUFFER_SIZE_MB * 1024 * 1024,
                  num_rdma_bytes=num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_local_experts,
                  allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, explicitly_destroy=True,
                  enable_shrink=enable_fault_tolerance)
    return deep_ep.Buffer(**kwargs)


def vllm_ll_prepare(buffer: object, a1: torch.Tensor, topk_ids: torch.Tensor, max_tokens_per_rank: int,
                    num_experts: int, use_fp8_dispatch: bool, use_ue8m0_dispatch: bool) -> tuple:
    """vLLM DeepEPLLPrepareAndFinalize `prepare_async` then `prepare`'s `hook()` (no NVFP4, no expert map).

    Returns `(expert_x, expert_num_tokens, handle)`; `expert_x` is `(fp8, scales)` with FP8 dispatch."""
    expert_x, expert_num_tokens, handle, _, hook = buffer.low_latency_dispatch(
        a1, topk_ids, max_tokens_per_rank, num_experts, use_fp8=use_fp8_dispatch, round_scale=use_ue8m0_dispatch,
        use_ue8m0=use_ue8m0_dispatch, async_finish=False, return_recv_hook=True)
    hook()
    return expert_x, expert_num_tokens, handle


def vllm_dequant_fp8(expert_x_fp8: torch.Tensor, expert_x_scales: torch.Tensor, block: int = 128) -> torch.Tensor:
    """vLLM `dequant_fp8` of deepep_ll.py: packed FP8 rows and their 1x128 scales back to float32."""
    assert expert_x_fp8.is_contiguous()
    expert_x_scales = expert_x_scales.contiguous()
    num_experts = expert_x_fp8.size(0)
    expert_x_fp32 = expert_x_fp8.to(torch.float32).view(num_experts, -1, block)
    return (expert_x_fp32 * expert_x_scales.view(num_experts, -1, 1)).view(expert_x_fp8.size())


def vllm_ll_finalize(buffer: object, handle: object, fused_expert_output: torch.Tensor, topk_ids: torch.Tensor,
                     topk_weights: torch.Tensor, output: torch.Tensor, do_async: bool) -> None:
    """vLLM DeepEPLLPrepareAndFinalize `_finalize` and the receive hook it hands back."""
    _, _, recv_hook = buffer.low_latency_combine(fused_expert_output, topk_ids, topk_weights, handle,
                                                 async_finish=False, zero_copy=False, return_recv_hook=do_async,
                                                 out=output)
    if recv_hook is not None:
        recv_hook()


# SGLang: `--deepep-config` (a JSON string or file) as its DeepEPConfig reads it.
SGLANG_DEEPEP_CONFIG = json.dumps({
    "normal_dispatch": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 16, "num_max_nvl_chunked_recv_tokens": 256,
                        "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128},
    "normal_combine": {"num_sms": 24, "num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256,
                       "num_max_rdma_chunked_send_tokens": 6, "num_max_rdma_chunked_recv_tokens": 128},
})


def sglang_configs(deep_ep: ModuleType, config_str: str) -> tuple[object, object, int]:
    """SGLang DeepEPConfig.__init__: `(normal_dispatch_config, normal_combine_config, num_sms)`."""
    parsed = json.loads(config_str)
    dispatch_config = deep_ep.Config(**parsed["normal_dispatch"])
    combine_config = deep_ep.Config(**parsed["normal_combine"])
    assert parsed["normal_dispatch"]["num_sms"] == parsed["normal_combine"]["num_sms"]
    return dispatch_config, combine_config, parsed["normal_dispatch"]["num_sms"]


def sglang_buffer_auto_mode(deep_ep: ModuleType, group: dist.ProcessGroup, hidden_size: int, param_bytes: int,
                            num_max_dispatch_tokens_per_rank: int, num_experts: int, configs: tuple,
                            use_fabric: bool) -> object:
    """SGLang DeepEPBuffer.get_deepep_buffer with `--deepep-mode auto` (normal and low-latency on one buffer).
    `use_fabric`: SGLang adds it on CUDA 13 machines with MNNVL fabric."""
    dispatch_config, combine_config, num_sms = configs
    num_nvl_bytes, num_rdma_bytes = 0, 0
    hidden_bytes = hidden_size * param_bytes
    for config in (dispatch_config or deep_ep.Buffer.get_dispatch_config(group.size()),
                   combine_config or deep_ep.Buffer.get_combine_config(group.size())):
        num_nvl_bytes = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), num_nvl_bytes)
        num_rdma_bytes = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), num_rdma_bytes)
    assert num_experts % group.size() == 0
    num_rdma_bytes = max(deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden_size,
                                                                       group.size(), num_experts), num_rdma_bytes)
    num_qps_per_rank = max(num_sms, num_experts // group.size())
    buffer_kwargs = dict(low_latency_mode=True, num_qps_per_rank=num_qps_per_rank, allow_mnnvl=use_fabric)
    if use_fabric:
        buffer_kwargs["use_fabric"] = True
    return deep_ep.Buffer(group, num_nvl_bytes, num_rdma_bytes, **buffer_kwargs)


def sglang_normal_dispatch(deep_ep: ModuleType, buffer: object, x: object, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, num_experts: int, dispatch_config: object,
                           expert_alignment: int) -> tuple:
    """SGLang _DeepEPDispatcherImplNormal `dispatch_a` (its Buffer.capture), `_dispatch_core` and `dispatch_b`,
    with `async_finish=True` as SGLang's MoE layers create it. `expert_alignment` is 128 with DeepGEMM.

    Returns `(recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle)`."""
    async_finish = True
    topk_ids = topk_ids.to(torch.int64)
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    (num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank,
     previous_event) = buffer.get_dispatch_layout(topk_ids, num_experts, previous_event=previous_event,
                                                  async_finish=async_finish,
                                                  allocate_on_comm_stream=previous_event is not None)
    recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle, event = buffer.dispatch(
        x, topk_idx=topk_ids, topk_weights=topk_weights, num_tokens_per_rank=num_tokens_per_rank,
        num_tokens_per_rdma_rank=num_tokens_per_rdma_rank, is_token_in_rank=is_token_in_rank,
        num_tokens_per_expert=num_tokens_per_expert, previous_event=previous_event, async_finish=async_finish,
        allocate_on_comm_stream=(previous_event is not None) and async_finish, expert_alignment=expert_alignment,
        config=dispatch_config)
    event.current_stream_wait() if async_finish else ()
    return recv_x, recv_topk_ids, recv_topk_weights, num_recv_tokens_per_expert, handle


def sglang_normal_combine(deep_ep: ModuleType, buffer: object, x: torch.Tensor, handle: object,
                          combine_config: object) -> torch.Tensor:
    """SGLang _DeepEPDispatcherImplNormal `combine_a`, `_combine_core` and `combine_b` (`async_finish=True`)."""
    async_finish = True
    previous_event = deep_ep.Buffer.capture() if async_finish else None
    combined_x, _, event = buffer.combine(x, handle, async_finish=async_finish, previous_event=previous_event,
                                          allocate_on_comm_stream=previous_event is not None, config=combine_config)
    event.current_stream_wait() if async_finish else ()
    return combined_x


def sglang_switch_to_low_latency(buffer: object, num_max_dispatch_tokens_per_rank: int, hidden_size: int,
                                 num_experts: int) -> None:
    """SGLang DeepEPBuffer.set_dispatch_mode_as_low_latency after normal mode: `clean_buffer`."""
    if buffer.low_latency_mode:
        buffer.clean_low_latency_buffer(num_max_dispatch_tokens_per_rank, hidden_size, num_experts)


def sglang_low_latency_dispatch(buffer: object, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                                num_max_dispatch_tokens_per_rank: int, num_experts: int, use_fp8: bool,
                                return_recv_hook: bool) -> tuple:
    """SGLang _DeepEPDispatcherImplLowLatency `dispatch_a`, `_dispatch_core` and `dispatch_b` on Hopper
    (no DeepGEMM UE8M0 scales, no NVFP4). Returns `(hidden_states, masked_m, expected_m, handle)`."""
    topk_ids = topk_ids.to(torch.int64)
    expected_m = (hidden_states.shape[0] * buffer.group_size * topk_ids.shape[1] + num_experts) // num_experts
    scale_opts = dict(round_scale=False, use_ue8m0=False) if use_fp8 else dict()
    packed_recv_hidden, packed_recv_count, handle, event, hook = buffer.low_latency_dispatch(
        hidden_states, topk_ids, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook, **scale_opts)
    hook() if return_recv_hook else event.current_stream_wait()
    return packed_recv_hidden, packed_recv_count, expected_m, handle


def sglang_low_latency_combine(buffer: object, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
                               topk_weights: torch.Tensor, handle: object, return_recv_hook: bool,
                               **overlap_args: object) -> torch.Tensor:
    """SGLang _DeepEPDispatcherImplLowLatency `combine_a`, `_combine_core` and `combine_b`; `overlap_args`
    are the single-batch-overlap arguments its DeepEP fork takes (empty unless that overlap is on)."""
    combined_hidden_states, event, hook = buffer.low_latency_combine(
        x=hidden_states, topk_idx=topk_ids, topk_weights=topk_weights, handle=handle,
        async_finish=not return_recv_hook, return_recv_hook=return_recv_hook, **overlap_args)
    hook() if return_recv_hook else event.current_stream_wait()
    return combined_hidden_states

