"""Low-latency mode of the CUDA backend: the low-latency kernels over an NVSHMEM symmetric buffer.

`LowLatencyRuntime` implements the four low-latency methods of `CommBackend` with the signatures and
results of the torch backend (docs/semantics.md); `CudaBackend` delegates to it. NVSHMEM joins the
process once, from the torch process group (rank 0's unique id travels by a uint8 tensor broadcast);
each runtime then allocates one symmetric buffer of `num_rdma_bytes`. Peers NVSHMEM maps into this
process (NVLink) are written with direct stores, others through NVSHMEM put-with-signal. A group on one
host with peer access everywhere uses `moe_ep._low_latency_p2p`, the same kernels built as whole-program
code without the put path (faster); others use `moe_ep._low_latency` (see `_choose_transport`).

Differences from the torch backend that the semantics allow: rows of `recv_x` past `recv_count` and
their `src_info` are left as they were; messages are packed source-major in token order, so the rows,
`layout_range` and `src_info` of received messages match the torch backend exactly.

Protocol rules the kernels rely on (see csrc/low_latency/):
* Receive phases run in the order of their send phases, and at most two operations are in flight
  (sent, not yet received: the buffer has two halves). A hook called out of order first completes the
  older pending receives; an operation that would exceed two in flight, or one without a hook, first
  completes the oldest pending receives itself (on its own stream; a hook called afterwards only makes
  the current stream wait for that). A hook runs at most once.
* Every rank issues the same sequence of low-latency operations with the same sizes. Changing the
  sizes (tokens, hidden, experts) completes every pending receive, then cleans the buffer collectively.
* A combine's send phase waits for its peers' send phase of the same operation (each rank sends the
  top-k ids and weights of its tokens to the ranks that reduce them), which the same sequence on every
  rank provides; its `topk_idx` must route the tokens as the dispatch behind the handle did.
A kernel that waits more than `MOE_EP_TIMEOUT_S` seconds (default 100, see `moe_ep.ops.settings`) for a
peer reports an error; the next call raises and the runtime stays unusable.

Elastic mode (`shrink=True`, `Buffer(enable_shrink=True)`): the kernels read a device rank mask
(`rank_mask()`), send nothing to a masked rank and wait for none, and a wait for a peer that times out
masks that peer and goes on instead of failing; `clean_low_latency_buffer` masks a peer that does not
reach its barrier. A masked rank that took part late may be unmasked once it has issued the same
operations as the others (the sequence numbers must agree); the collective `destroy` still needs every
rank.
"""

from __future__ import annotations

import faulthandler
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import threading
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..handles import LowLatencyHandle
from ..requests import LowLatencyCombineRequest, LowLatencyDispatchRequest
from ..settings import INIT_TIMEOUT_ENV, settings
from ..topology import gather_host_records
from .base import LowLatencyDispatchResult, RecvHook
from .collectives import broadcast_bytes

_SEND, _RECV = 1, 2
_MAX_IN_FLIGHT = 2  # operations sent but not yet received: one per half of the buffer
# Global ranks of the group NVSHMEM joined this process with (NVSHMEM initialises once per process).
_nvshmem_members: Optional[tuple[int, ...]] = None
# Transport -> module. "nvshmem_puts": the relocatable module sending to every peer through NVSHMEM puts
# even where NVSHMEM maps it, so that one node runs the path that peers without P2P take.
_MODULES = {"nvshmem": "moe_ep._low_latency", "p2p": "moe_ep._low_latency_p2p", "nvshmem_puts": "moe_ep._low_latency"}
# The low-latency module of this process, chosen when NVSHMEM joins it (`_choose_transport`).
_transport = "nvshmem"


@functools.cache
def _module(name: str):
    return importlib.import_module(name)


def _ext():
    return _module(_MODULES[_transport])


def low_latency_available() -> bool:
    """Whether the extension `moe_ep._low_latency` (low-latency kernels and NVSHMEM runtime) was built."""
    try:
        _module(_MODULES["nvshmem"])
    except ImportError:
        return False
    return True


def _gpu_record(device: torch.device) -> bytes:
    """This rank's GPU for `gather_host_records`: its index (4 bytes, for peer access) and a digest of its
    UUID (16 bytes: processes that each see one GPU all report index 0; the index where a torch build
    has no UUID)."""
    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", device.index)).encode()
    return device.index.to_bytes(4, "little") + hashlib.blake2b(uuid, digest_size=16).digest()


def check_even_gpu_sharing(records: list[tuple[bytes, bytes]]) -> None:
    """Raise, on every rank alike, when the GPUs of one host hold different numbers of ranks (`records`:
    every rank's `(host id, _gpu_record)`). NVSHMEM's initialisation waits forever for such a group (6 PEs
    on 4 GPUs, two GPUs with two each, hangs in its bootstrap while the lone PEs spin), with no timeout of
    its own; one rank per GPU, or the same number on every GPU of a host, initialises."""
    hosts: dict[bytes, dict[bytes, list[int]]] = {}
    for rank, (host, gpu) in enumerate(records):
        hosts.setdefault(host, {}).setdefault(gpu[4:], []).append(rank)
    for number, gpus in enumerate(hosts.values()):
        if len({len(ranks) for ranks in gpus.values()}) > 1:
            placement = "; ".join(f"GPU {int.from_bytes(records[ranks[0]][1][:4], 'little')}: ranks {ranks}"
                                  for ranks in gpus.values())
            raise RuntimeError(f"NVSHMEM: the GPUs of host {number} hold different numbers of ranks ({placement}); "
                               "NVSHMEM's initialisation hangs on such a placement: give every GPU of a host the "
                               "same number of ranks (one each for speed)")


def _choose_transport(records: list[tuple[bytes, bytes]]) -> tuple[bool, str]:
    """(whether the group is on one host, the transport: "p2p", "nvshmem" or, forced only, "nvshmem_puts"),
    from every rank's `(host id, _gpu_record)`.

    "p2p" (`moe_ep._low_latency_p2p`: whole-program kernels writing every peer with direct stores) when
    the group is on one host and its GPUs have peer access to each other; "nvshmem" (relocatable kernels,
    NVSHMEM puts for peers without P2P) otherwise. `MOE_EP_LOW_LATENCY_TRANSPORT=p2p|nvshmem|nvshmem_puts`
    overrides (`moe_ep.ops.settings`).
    """
    forced = settings().low_latency_transport
    single_host = len({host for host, _ in records}) == 1
    if forced != "auto":
        return single_host, forced
    if not single_host or importlib.util.find_spec(_MODULES["p2p"]) is None:  # the P2P module was not built
        return single_host, "nvshmem"
    # Processes that see one GPU each all report index 0: the runtime then checks the mappings itself.
    devices = {int.from_bytes(gpu[:4], "little") for _, gpu in records}
    peer_access = all(torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices if a != b)
    return single_host, "p2p" if peer_access else "nvshmem"


def nvshmem_module():
    """`moe_ep._low_latency`: the module with NVSHMEM's device library (internode mode lives there too)."""
    return _module(_MODULES["nvshmem"])


def init_nvshmem(group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device,
                 device_api: bool = False) -> None:
    """Join this process to the NVSHMEM job of `group` (once per process), then meet every rank of `group`
    in a barrier: callers allocate symmetric memory next, which is collective in NVSHMEM with no timeout,
    so a rank that never comes fails the others here, through the process group's timeout, instead.
    `device_api`: the caller's kernels use NVSHMEM's device API (internode mode), so the P2P-only module,
    which initialises NVSHMEM's host library alone, cannot be the one that joins."""
    global _nvshmem_members
    members = tuple(dist.get_process_group_ranks(group))
    if _nvshmem_members is not None:
        if members != _nvshmem_members:
            raise RuntimeError(f"NVSHMEM already joined this process with group {_nvshmem_members}; every "
                               f"low-latency or internode Buffer of a process must use the same group, got {members}")
        if device_api and _transport == "p2p":
            raise RuntimeError("internode mode: NVSHMEM joined this process through moe_ep._low_latency_p2p (a "
                               "low-latency Buffer created first); set MOE_EP_LOW_LATENCY_TRANSPORT=nvshmem")
    else:
        _join(group, rank, num_ranks, device, device_api)
        _nvshmem_members = members
    dist.barrier(group=group, device_ids=[device.index])


def _join(group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device, device_api: bool) -> None:
    """NVSHMEM's initialisation from rank 0's unique id, through the module of the chosen transport."""
    global _transport
    # NVLink SHArP (multicast) stays off: it can take down GPUs shared with others. Without another
    # host in the group no remote transport is needed, which also skips probing for InfiniBand.
    # NVSHMEM takes both settings from the environment only, read by its init below: this is the one
    # place the library writes the process environment (setdefault: a user's own choice stands).
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    records = gather_host_records(group, num_ranks, device, _gpu_record(device))
    check_even_gpu_sharing(records)
    single_host, _transport = _choose_transport(records)
    if device_api and _transport == "p2p":
        _transport = "nvshmem"
    if single_host:
        os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")
    runtime = _ext().NvshmemRuntime
    unique_id = runtime.create_unique_id() if rank == 0 else None
    unique_id = broadcast_bytes(unique_id, runtime.unique_id_bytes(), group, device)
    run_within_timeout(lambda: runtime.init(unique_id, rank, num_ranks), settings().init_timeout_s,
                       "NVSHMEM's initialisation (every rank of the group must reach it, with the GPUs of each host "
                       "holding the same number of ranks)")


def run_within_timeout(fn: Callable[[], None], timeout_s: float, what: str) -> None:
    """Run `fn`, NVSHMEM's initialisation: a collective step with no timeout of its own that cannot be
    interrupted (it runs in C++ with the GIL released). If it has not returned after `timeout_s`
    (`MOE_EP_INIT_TIMEOUT_S`), this process cannot go on: the reason and every thread's Python stack go to
    stderr and the process exits with status 1, so that its launcher or scheduler sees a failure instead
    of a hang (as torch's NCCL watchdog does)."""
    finished = threading.Event()

    def watch() -> None:
        if not finished.wait(timeout_s):
            sys.stderr.write(f"moe_ep: {what} did not finish within {timeout_s:g} s ({INIT_TIMEOUT_ENV}); it cannot "
                             "be interrupted, so this process exits. Python stacks:\n")
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.flush()
            os._exit(1)

    threading.Thread(target=watch, name="moe_ep-deadline", daemon=True).start()
    try:
        fn()
    finally:
        finished.set()


class _ReceiveHook:
    """A pending receive phase: `runtime` launches it in send order (see `LowLatencyRuntime._complete`)."""

    def __init__(self, runtime: "LowLatencyRuntime", launch: Callable[[], None]) -> None:
        self._runtime = runtime
        self.launch = launch
        self.done: Optional[torch.cuda.Event] = None  # recorded when launched on behalf of a later call

    def __call__(self) -> None:
        self._runtime._complete(through=self)
        if self.done is not None:
            torch.cuda.current_stream().wait_event(self.done)


class LowLatencyRuntime:
    """The low-latency half of the CUDA backend (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, num_rdma_bytes: int,
                 timeout_s: Optional[float] = None, shrink: bool = False, num_ranks_per_node: int = 0) -> None:
        """`shrink`: elastic mode (a rank mask, docs/semantics.md). `num_ranks_per_node` > 0 groups the ranks
        into (virtual) nodes of that many: peers on other nodes are reached through NVSHMEM puts, never
        direct stores, even where NVSHMEM maps them (0: the hosts decide, through what NVSHMEM can map)."""
        if not low_latency_available():
            raise RuntimeError("low-latency mode: moe_ep._low_latency was not built (it needs NVSHMEM: install "
                               "nvidia-nvshmem-cu12/cu13 or set NVSHMEM_DIR, then rebuild); use backend='torch'")
        if num_rdma_bytes <= 0:
            raise ValueError("num_rdma_bytes: low-latency mode needs a symmetric buffer; size it with "
                             "Buffer.get_low_latency_rdma_size_hint")
        self.group, self.rank, self.num_ranks = group, rank, num_ranks
        self.device = torch.device("cuda", torch.cuda.current_device())
        if timeout_s is None:
            timeout_s = settings().timeout_s
        across_nodes = 0 < num_ranks_per_node < num_ranks
        # Puts need NVSHMEM's device library: the P2P-only module cannot serve ranks across nodes.
        init_nvshmem(group, rank, num_ranks, self.device, device_api=across_nodes)
        self._runtime = _ext().NvshmemRuntime(rank, num_ranks, num_rdma_bytes, timeout_s,
                                              puts_only=_transport == "nvshmem_puts", shrink=shrink,
                                              ranks_per_node=num_ranks_per_node if across_nodes else 0)
        self._rank_mask = _ext().ll_rank_mask(self._runtime) if shrink else None
        self._in_flight: list[_ReceiveHook] = []  # pending receives, oldest first
        self._sizes: Optional[tuple[int, int, int]] = None

    def check_usable(self) -> None:
        """Raise the `RuntimeError` of a kernel that gave up waiting for a peer (the runtime is unusable
        after that); a receive phase only reports at the next call otherwise."""
        self._runtime.check_usable()

    def _complete(self, through: Optional[_ReceiveHook] = None, keep: int = 0) -> None:
        """Launch pending receives oldest first: up to and including `through` if given, else until
        at most `keep` remain."""
        while self._in_flight and (through in self._in_flight if through is not None else len(self._in_flight) > keep):
            hook = self._in_flight.pop(0)
            hook.launch()
            if hook is not through:
                hook.done = torch.cuda.Event()
                hook.done.record()

    def _run(self, sizes: tuple[int, int, int], launch: Callable[[int], None],
             return_recv_hook: bool) -> Optional[RecvHook]:
        """Launch one operation: both phases, or the send phase and a hook for the receive phase."""
        self.check_usable()
        if sizes != self._sizes:  # new sizes clean the buffer: nothing may be in flight
            self._complete()
            self._sizes = sizes
        self._complete(keep=_MAX_IN_FLIGHT - 1 if return_recv_hook else 0)
        if not return_recv_hook:
            launch(_SEND | _RECV)
            return None
        launch(_SEND)
        hook = _ReceiveHook(self, lambda: launch(_RECV))
        self._in_flight.append(hook)
        return hook

    def low_latency_dispatch(self, request: LowLatencyDispatchRequest
                             ) -> tuple[LowLatencyDispatchResult, Optional[RecvHook]]:
        r = request
        max_tokens, hidden, num_experts = r.num_max_dispatch_tokens_per_rank, r.x.size(1), r.num_experts
        mode = (2 if r.use_ue8m0 else 1) if r.use_fp8 else 0
        recv_x, recv_scales, src_info, layout_range, recv_count = _ext().ll_dispatch_outputs(
            self._runtime, r.x, max_tokens, num_experts, mode)

        def launch(phases: int) -> None:
            _ext().ll_dispatch(self._runtime, r.x, r.topk_idx, recv_x, recv_scales, src_info, layout_range, recv_count,
                               r.cumulative_local_expert_recv_stats, r.dispatch_wait_recv_cost_stats, max_tokens,
                               num_experts, mode, r.round_scale, phases)

        hook = self._run((max_tokens, hidden, num_experts), launch, r.return_recv_hook)
        handle = LowLatencyHandle(src_info, layout_range, max_tokens, hidden, num_experts)
        return LowLatencyDispatchResult(recv_x, recv_scales, recv_count, handle), hook

    def low_latency_combine(self, request: LowLatencyCombineRequest) -> tuple[torch.Tensor, Optional[RecvHook]]:
        r, handle = request, request.handle
        combined = r.out if r.out is not None else torch.empty(r.topk_idx.size(0), handle.hidden, dtype=torch.bfloat16,
                                                               device=r.topk_idx.device)

        def launch(phases: int) -> None:
            _ext().ll_combine(self._runtime, r.x, r.zero_copy, handle.src_info, handle.layout_range, r.topk_idx,
                              r.topk_weights, combined, r.combine_wait_recv_cost_stats,
                              handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, r.use_logfmt,
                              phases)

        sizes = (handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts)
        return combined, self._run(sizes, launch, r.return_recv_hook)

    def get_next_low_latency_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The send region as `[E_local, R*max, H]` bf16; a zero-copy combine sends from it."""
        return _ext().ll_send_buffer(self._runtime, handle.num_max_dispatch_tokens_per_rank, handle.hidden,
                                     handle.num_experts)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the symmetric buffer on every rank (collective, on the current stream)."""
        self.check_usable()
        self._complete()
        self._runtime.clean()

    def rank_mask(self) -> torch.Tensor:
        """Elastic mode: the device rank mask `[R]` int32 the kernels read (and set on timeouts)."""
        if self._rank_mask is None:
            raise ValueError("enable_shrink: the low-latency runtime was created without elastic mode")
        return self._rank_mask

    def local_buffer(self) -> torch.Tensor:
        """The whole symmetric buffer as uint8: a view of the memory the kernels use."""
        self.check_usable()
        return _ext().ll_local_buffer(self._runtime)

    def destroy(self) -> None:
        """Free the symmetric buffer (collective); the runtime is unusable afterwards."""
        self._in_flight.clear()
        torch.cuda.synchronize(self.device)
        self._runtime.destroy()
