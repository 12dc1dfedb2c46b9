"""DeepEP V1's Buffer surface beyond dispatch and combine: every public method and constructor argument
exists, `get_local_buffer_tensor`, `comm=` (an mpi4py-like communicator: the default group, a subgroup,
or no torch.distributed yet), `use_fabric`, and the internode entry points (torch backend, CPU)."""

from __future__ import annotations

import inspect
import pickle
import queue
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import moe_ep
from reference import combine_reference, expert_output, make_inputs

# DeepEP V1's `deep_ep.Buffer`: its public methods and its constructor's arguments, in its order.
DEEPEP_V1_METHODS = (
    "destroy", "is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_comm_stream",
    "get_local_buffer_tensor", "get_dispatch_config", "get_combine_config", "get_dispatch_layout", "dispatch",
    "combine", "internode_dispatch", "internode_combine", "clean_low_latency_buffer", "low_latency_dispatch",
    "low_latency_combine", "low_latency_update_mask_buffer", "low_latency_query_mask_buffer",
    "low_latency_clean_mask_buffer", "get_next_low_latency_combine_buffer",
)
DEEPEP_V1_ARGUMENTS = ("group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                       "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "explicitly_destroy", "enable_shrink",
                       "comm", "use_fabric")


def test_every_deepep_v1_method_and_argument_exists() -> None:
    missing = [name for name in DEEPEP_V1_METHODS if not callable(getattr(moe_ep.Buffer, name, None))]
    assert not missing
    parameters = inspect.signature(moe_ep.Buffer.__init__).parameters
    assert [name for name in DEEPEP_V1_ARGUMENTS if name not in parameters] == []


# ------------------------------------------------------------------ get_local_buffer_tensor


def _local_buffer_tensor(rank: int, world: int) -> None:
    nvl_bytes, rdma_bytes = 4096, 1 << 16
    buffer = moe_ep.Buffer(dist.group.WORLD, nvl_bytes, rdma_bytes, backend="torch")
    raw = buffer.get_local_buffer_tensor(torch.uint8)
    assert raw.shape == (nvl_bytes,) and raw.dtype == torch.uint8
    floats = buffer.get_local_buffer_tensor(torch.float32, offset=64)
    assert floats.shape == ((nvl_bytes - 64) // 4,)
    values = torch.randn(floats.numel(), generator=torch.Generator().manual_seed(rank))
    floats.copy_(values)
    # The same memory every time: the bytes written through one view are read through another.
    again = buffer.get_local_buffer_tensor(torch.float32, size=torch.Size([3, 5]), offset=64)
    assert torch.equal(again, values[:15].view(3, 5))
    assert torch.equal(raw[64:68], values[:1].view(torch.uint8))
    rdma = buffer.get_local_buffer_tensor(torch.int8, use_rdma_buffer=True)
    assert rdma.shape == (rdma_bytes,) and rdma.data_ptr() != raw.data_ptr()
    with pytest.raises(ValueError, match="offset: expected a multiple of 4 bytes"):
        buffer.get_local_buffer_tensor(torch.float32, offset=6)
    with pytest.raises(ValueError, match="size: "):
        buffer.get_local_buffer_tensor(torch.float64, size=(1000,))
    with pytest.raises(TypeError, match="dtype: expected a torch.dtype"):
        buffer.get_local_buffer_tensor("float32")
    empty = moe_ep.Buffer(dist.group.WORLD, 0, 0, backend="torch")
    with pytest.raises(ValueError, match="num_nvl_bytes=0"):
        empty.get_local_buffer_tensor(torch.uint8)
    assert buffer.get_comm_stream() is None  # no CUDA here


def test_get_local_buffer_tensor(dist_pool) -> None:
    dist_pool(2).run(_local_buffer_tensor)


def _use_fabric(rank: int, world: int) -> None:
    moe_ep.Buffer(dist.group.WORLD, use_fabric=False)
    with pytest.raises(ValueError, match="use_fabric: fabric memory handles"):
        moe_ep.Buffer(dist.group.WORLD, use_fabric=True)


def test_use_fabric_true_is_refused(dist_pool) -> None:
    dist_pool(2).run(_use_fabric)


# ------------------------------------------------------------------ comm=


class StoreComm:
    """The four mpi4py communicator methods moe_ep calls, over a torch.distributed store (no MPI here)."""

    def __init__(self, store: dist.Store, rank: int, size: int, name: str = "comm") -> None:
        self.store, self.rank, self.size, self.name = store, rank, size, name
        self.calls = 0

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's names)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size

    def _key(self, what: str) -> str:
        self.calls += 1
        return f"{self.name}/{what}{self.calls}"

    def bcast(self, obj: object, root: int = 0) -> object:
        key = self._key("bcast")
        if self.rank == root:
            self.store.set(key, pickle.dumps(obj))
        return pickle.loads(self.store.get(key))

    def allgather(self, obj: object) -> list:
        key = self._key("allgather")
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        return [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.size)]


def _round_trip(buffer: moe_ep.Buffer, seed: int) -> bool:
    """A normal-mode dispatch and combine on `buffer`'s group, exact against the reference."""
    group_rank, world = buffer.rank, buffer.group_size
    num_experts = 3 * world
    inputs = make_inputs(seed, world, [9 + 4 * r for r in range(world)], 128, num_experts, 2)
    mine = inputs[group_rank]
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(mine.topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(mine.x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=mine.topk_idx)
    combined, _, _ = buffer.combine(expert_output(recv_x, group_rank), handle)
    return torch.equal(combined, combine_reference(inputs, group_rank, num_experts)[0])


def _comm_over_initialized_group(rank: int, world: int, order: str) -> tuple[int, int, bool]:
    store = dist.distributed_c10d._get_default_store()
    whole = StoreComm(store, rank, world, f"whole_{order}")
    buffer = moe_ep.Buffer(None, 1 << 20, comm=whole, backend="torch")
    assert buffer.group is dist.group.WORLD and (buffer.rank, buffer.group_size) == (rank, world)
    # A communicator of the even ranks only: the odd ones never take part.
    if rank % 2 == 1:
        return rank, world, True
    evens = list(range(0, world, 2))
    position = evens.index(rank) if order == "ascending" else len(evens) - 1 - evens.index(rank)
    sub = StoreComm(store, position, len(evens), f"evens_{order}")
    if order != "ascending":
        with pytest.raises(ValueError, match="comm: its ranks must be in torch.distributed's rank order"):
            moe_ep.Buffer(None, 1 << 20, comm=sub, backend="torch")
        return rank, world, True
    buffer = moe_ep.Buffer(None, 1 << 20, comm=sub, backend="torch")
    assert dist.get_process_group_ranks(buffer.group) == evens
    return buffer.rank, buffer.group_size, _round_trip(buffer, 5)


@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_comm_names_the_group(dist_pool, order: str) -> None:
    outcomes = dist_pool(3).run(_comm_over_initialized_group, order)
    if order == "ascending":
        assert outcomes == [(0, 2, True), (1, 3, True), (1, 2, True)]


def _uninitialized_rank(rank: int, world: int, path: str, results: object) -> None:
    try:
        store = dist.FileStore(path, world)
        comm = StoreComm(store, rank, world)
        assert not dist.is_initialized()
        buffer = moe_ep.Buffer(None, 1 << 20, comm=comm, backend="torch")
        outcome = (dist.get_rank(), dist.get_world_size(), _round_trip(buffer, 11))
        dist.destroy_process_group()
        results.put((rank, outcome))
    except BaseException as exc:  # the test reports every rank's error
        results.put((rank, repr(exc)))


def test_comm_initializes_torch_distributed(tmp_path) -> None:
    """No process group yet: the Buffer initializes one over the communicator's processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world = 2
    procs = [ctx.Process(target=_uninitialized_rank, args=(r, world, str(tmp_path / "store"), results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    outcomes = {}
    try:
        for _ in range(world):
            rank, outcome = results.get(timeout=timedelta(seconds=120).total_seconds())
            outcomes[rank] = outcome
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert outcomes == {0: (0, 2, True), 1: (1, 2, True)}


# ------------------------------------------------------------------ internode entry points


def _internode_entry_points(rank: int, world: int) -> bool:
    buffer = moe_ep.Buffer(dist.group.WORLD, backend="torch")
    num_experts = 2 * world
    inputs = make_inputs(3, world, [12, 7, 20][:world], 128, num_experts, 2)
    mine = inputs[rank]
    per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(mine.topk_idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.internode_dispatch(
        mine.x, None, per_rank, per_rdma, in_rank, per_expert, mine.topk_idx, mine.topk_weights)
    cached = buffer.internode_dispatch(mine.x, handle)[0]
    combined, _, _ = buffer.internode_combine(expert_output(recv_x, rank), handle)
    return torch.equal(cached, recv_x) and torch.equal(combined, combine_reference(inputs, rank, num_experts)[0])


def test_internode_entry_points_are_dispatch_and_combine(dist_pool) -> None:
    assert all(dist_pool(3).run(_internode_entry_points))
