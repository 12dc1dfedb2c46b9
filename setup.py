"""Build script: pure Python on CPU machines, plus the CUDA extensions where they can be built:
`moe_ep._C` (normal-mode kernels and runtime), `moe_ep._low_latency` and `moe_ep._low_latency_p2p`
(low-latency kernels and NVSHMEM runtime) and `moe_ep._fp8` (the FP8 expert kernels).

`MOE_EP_BUILD_CUDA=1` forces the extensions (failing loudly if they cannot be built), `=0` skips them;
unset, they are built when the installed torch has CUDA and `nvcc` is found. The low-latency modules
(sources named `low_latency*` or `nvshmem*`) need NVSHMEM (`NVSHMEM_DIR` or an
`nvidia-nvshmem-cu12/cu13` wheel) and are skipped without it or with `MOE_EP_BUILD_LOW_LATENCY=0`.
NVSHMEM's device library needs relocatable device code (`-rdc=true`); that is why `moe_ep._low_latency`
is a module of its own, and why `moe_ep._low_latency_p2p` (the same kernels without NVSHMEM device calls,
for groups whose peers are all mapped) exists: every other module stays whole-program code (under `-rdc`
the FP8 GEMM spills and runs 2.4x slower, the normal-mode combine ran 24 % slower).
CUDA builds need the installed torch: `pip install --no-build-isolation -e .`.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()


def _want_cuda() -> bool:
    forced = os.environ.get("MOE_EP_BUILD_CUDA")
    if forced == "0":
        return False
    try:
        import torch
    except ImportError:
        if forced == "1":
            sys.exit("MOE_EP_BUILD_CUDA=1 but torch is not importable: use pip install --no-build-isolation")
        return False
    has_cuda = torch.version.cuda is not None and shutil.which("nvcc") is not None
    if forced == "1" and not has_cuda:
        sys.exit("MOE_EP_BUILD_CUDA=1 but torch has no CUDA or nvcc is not on PATH")
    return has_cuda and bool(_sources())


def _all_sources() -> list[str]:
    return sorted(glob.glob("csrc/*.cpp")) + sorted(glob.glob("csrc/*.cu")) + sorted(glob.glob("csrc/kernels/*.cu"))


def _is_low_latency(path: str) -> bool:
    """Low-latency-mode files (their own kernels, binding and NVSHMEM runtime) are built as one part."""
    return any(marker in Path(path).name for marker in ("low_latency", "nvshmem"))


def _is_fp8(path: str) -> bool:
    """The FP8 expert kernels (`fp8_*` files: binding, GEMM, weight cast) are a module of their own:
    never relocatable device code, under which ptxas ignores the GEMM's `setmaxnreg` budget."""
    return Path(path).name.startswith("fp8_")


def _sources() -> list[str]:
    return [f for f in _all_sources() if not _is_low_latency(f) and not _is_fp8(f)]


def _low_latency_sources() -> list[str]:
    """Empty when `MOE_EP_BUILD_LOW_LATENCY=0` leaves them out."""
    if os.environ.get("MOE_EP_BUILD_LOW_LATENCY", "1") == "0":
        return []
    return [f for f in _all_sources() if _is_low_latency(f)]


def _nvshmem_dir() -> str | None:
    if os.environ.get("NVSHMEM_DIR"):
        return os.environ["NVSHMEM_DIR"]
    try:
        import nvidia.nvshmem as nvshmem  # type: ignore[import-not-found]
    except ImportError:
        return None
    return str(Path(nvshmem.__path__[0]))


def _common_flags() -> tuple[list[str], list[str], list[str]]:
    """(include dirs, nvcc flags, cxx flags) shared by all extensions."""
    from torch.utils.cpp_extension import CUDA_HOME

    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")  # sm_90a: the FP8 GEMM uses wgmma
    include_dirs = [str(ROOT / "csrc"), str(ROOT / "csrc" / "kernels"), os.path.join(CUDA_HOME, "include", "cccl")]
    # No -std here: BuildExtension picks the standard the installed torch headers need (C++17 or 20);
    # the kernels themselves stay valid C++17 (CI compiles them alone).
    # torch's default nvcc flags hide the half/bfloat16 operators, which NVSHMEM's headers use.
    nvcc_flags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"] + [
        f"-U__CUDA_NO_{kind}__" for kind in ("HALF_OPERATORS", "HALF_CONVERSIONS", "HALF2_OPERATORS",
                                             "BFLOAT16_OPERATORS", "BFLOAT16_CONVERSIONS", "BFLOAT162_OPERATORS")]
    return include_dirs, nvcc_flags, ["-O3"]


def _cuda_extension():
    from torch.utils.cpp_extension import CUDAExtension

    include_dirs, nvcc_flags, cxx_flags = _common_flags()
    if os.environ.get("MOE_EP_PROFILE") == "1":
        # Per-phase timing inside the dispatch/combine kernels (moe_ep._C.last_profile); off by default.
        nvcc_flags.append("-DMOE_EP_PROFILE")
        cxx_flags.append("-DMOE_EP_PROFILE")
    return CUDAExtension(
        name="moe_ep._C",
        sources=_sources(),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


def _low_latency_extensions():
    """The two low-latency modules, or none without their sources or without NVSHMEM.

    `moe_ep._low_latency`: relocatable device code linked against NVSHMEM's device library; peers without
    P2P are reached through NVSHMEM puts. `moe_ep._low_latency_p2p`: the same sources (`csrc/p2p/`
    includes them) as whole-program code over NVSHMEM's host library only, for groups whose peers are all
    mapped; relocatable code runs these kernels slower, as it did the normal-mode combine.
    """
    from torch.utils.cpp_extension import CUDAExtension

    sources, nvshmem = _low_latency_sources(), _nvshmem_dir()
    if not sources or not nvshmem:
        return []
    lib = os.path.join(nvshmem, "lib")
    # The wheel ships only the versioned host library, hence the explicit file names.
    host_link = [f"-L{lib}", "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{lib}"]

    def extension(name: str, ext_sources: list[str], defines: list[str], link_args: list[str],
                  nvcc_extra: tuple[str, ...] = (), dlink: tuple[str, ...] = ()) -> CUDAExtension:
        include_dirs, nvcc_flags, cxx_flags = _common_flags()
        compile_args = {"cxx": cxx_flags + defines, "nvcc": nvcc_flags + list(nvcc_extra) + defines}
        if dlink:
            compile_args["nvcc_dlink"] = list(dlink)
        return CUDAExtension(name=name, sources=ext_sources, library_dirs=[lib], extra_link_args=link_args,
                             include_dirs=include_dirs + [os.path.join(nvshmem, "include")],
                             extra_compile_args=compile_args)

    return [
        # Relocatable device code needs a device-link step against NVSHMEM's device library.
        extension("moe_ep._low_latency", sources, ["-DMOE_EP_WITH_NVSHMEM"],
                  [f"-L{lib}", "-l:libnvshmem_device.a"] + host_link, nvcc_extra=("-rdc=true",),
                  dlink=("-dlink", f"-L{lib}", "-lnvshmem_device")),
        extension("moe_ep._low_latency_p2p", sorted(glob.glob("csrc/p2p/*")), ["-DMOE_EP_LL_P2P_ONLY"], host_link),
    ]


def _fp8_extension():
    from torch.utils.cpp_extension import CUDAExtension

    include_dirs, nvcc_flags, cxx_flags = _common_flags()
    return CUDAExtension(
        name="moe_ep._fp8",
        sources=[f for f in _all_sources() if _is_fp8(f)],
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


ext_modules = []
cmdclass = {}
if _want_cuda():
    from torch.utils.cpp_extension import BuildExtension

    ext_modules = [_cuda_extension(), *_low_latency_extensions(), _fp8_extension()]
    cmdclass = {"build_ext": BuildExtension.with_options(use_ninja=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
