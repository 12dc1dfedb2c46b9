"""Build script: pure Python on CPU machines, plus the CUDA extensions where they can be built:
`moe_ep._C` (normal-mode kernels and runtime), `moe_ep._low_latency` (low-latency and internode kernels,
NVSHMEM runtime), `moe_ep._low_latency_p2p` (the low-latency kernels without NVSHMEM's device library) and
`moe_ep._fp8` (the FP8 expert kernels). Each module is built from folders of `csrc/` (see `_MODULES` and
csrc/README.md); `csrc/common` holds headers only.

`MOE_EP_BUILD_CUDA=1` forces the extensions (failing loudly if they cannot be built), `=0` skips them;
unset, they are built when the installed torch has CUDA and `nvcc` is found. The low-latency modules
(`csrc/low_latency`) need NVSHMEM (`NVSHMEM_DIR` or an `nvidia-nvshmem-cu12/cu13` wheel) and are
skipped without it or with `MOE_EP_BUILD_LOW_LATENCY=0`.
NVSHMEM's device library needs relocatable device code (`-rdc=true`); that is why `moe_ep._low_latency`
is a module of its own, and why `moe_ep._low_latency_p2p` (the same sources compiled with
`MOE_EP_LL_P2P_ONLY`: no NVSHMEM device calls, for groups whose peers are all mapped) exists: every
other module stays whole-program code (under `-rdc` the FP8 GEMM spills and runs 2.4x slower, the
normal-mode combine ran 24 % slower). `MOE_EP_PROFILE=1` adds per-phase timing to `moe_ep._C`.
`MOE_EP_BUILD_MODULES` (comma list, e.g. `moe_ep._C,moe_ep._low_latency_p2p`) builds only those modules,
for a quick device run that needs no others.
CUDA builds need the installed torch: `pip install --no-build-isolation -e .`.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent.resolve()

# The csrc folders each extension module is built from (every .cpp and .cu under them). Internode mode
# shares the relocatable low-latency module: NVSHMEM keeps one device state per module, and both modes'
# kernels must see the one NVSHMEM job the process joined.
_MODULES = {
    "moe_ep._C": ("intranode",),
    "moe_ep._low_latency": ("low_latency", "internode"),
    "moe_ep._low_latency_p2p": ("low_latency",),
    "moe_ep._fp8": ("fp8",),
}


def _sources(module: str) -> list[str]:
    folders = [ROOT / "csrc" / folder for folder in _MODULES[module]]
    return sorted(str(f.relative_to(ROOT)) for folder in folders for pattern in ("*.cpp", "*.cu")
                  for f in folder.rglob(pattern))


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
    return has_cuda and bool(_sources("moe_ep._C"))


def _low_latency_wanted() -> bool:
    """False when `MOE_EP_BUILD_LOW_LATENCY=0` leaves the low-latency modules out."""
    return os.environ.get("MOE_EP_BUILD_LOW_LATENCY", "1") != "0"


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
    include_dirs = [str(ROOT / "csrc"), os.path.join(CUDA_HOME, "include", "cccl")]
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
        sources=_sources("moe_ep._C"),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


def _low_latency_extensions():
    """The two low-latency modules, or none without their sources or without NVSHMEM.

    `moe_ep._low_latency`: relocatable device code linked against NVSHMEM's device library; peers without
    P2P are reached through NVSHMEM puts. `moe_ep._low_latency_p2p`: the same sources compiled with
    `MOE_EP_LL_P2P_ONLY` (no NVSHMEM device calls) as whole-program code over NVSHMEM's host library only,
    for groups whose peers are all mapped; relocatable code runs these kernels slower, as it did the
    normal-mode combine.
    """
    from torch.utils.cpp_extension import CUDAExtension

    nvshmem = _nvshmem_dir()
    if not _low_latency_wanted() or not _sources("moe_ep._low_latency") or not nvshmem:
        return []
    lib = os.path.join(nvshmem, "lib")
    # The wheel ships only the versioned host library, hence the explicit file names.
    host_link = [f"-L{lib}", "-l:libnvshmem_host.so.3", f"-Wl,-rpath,{lib}"]

    def extension(name: str, defines: list[str], link_args: list[str], nvcc_extra: tuple[str, ...] = (),
                  dlink: tuple[str, ...] = ()) -> CUDAExtension:
        include_dirs, nvcc_flags, cxx_flags = _common_flags()
        compile_args = {"cxx": cxx_flags + defines, "nvcc": nvcc_flags + list(nvcc_extra) + defines}
        if dlink:
            compile_args["nvcc_dlink"] = list(dlink)
        return CUDAExtension(name=name, sources=_sources(name), library_dirs=[lib], extra_link_args=link_args,
                             include_dirs=include_dirs + [os.path.join(nvshmem, "include")],
                             extra_compile_args=compile_args)

    return [
        # Relocatable device code needs a device-link step against NVSHMEM's device library.
        extension("moe_ep._low_latency", [], [f"-L{lib}", "-l:libnvshmem_device.a"] + host_link,
                  nvcc_extra=("-rdc=true",), dlink=("-dlink", f"-L{lib}", "-lnvshmem_device")),
        extension("moe_ep._low_latency_p2p", ["-DMOE_EP_LL_P2P_ONLY"], host_link),
    ]


def _fp8_extension():
    from torch.utils.cpp_extension import CUDAExtension

    include_dirs, nvcc_flags, cxx_flags = _common_flags()
    return CUDAExtension(
        name="moe_ep._fp8",
        sources=_sources("moe_ep._fp8"),
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
    )


def _build_ext_command():
    from torch.utils.cpp_extension import BuildExtension

    class BuildEachInItsOwnFolder(BuildExtension):
        """Compiles every extension into a temporary folder of its own: the two low-latency modules build
        the same sources with different flags, and their object files must not overwrite each other."""

        def build_extension(self, ext) -> None:
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name)
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared

    return BuildEachInItsOwnFolder.with_options(use_ninja=True)


ext_modules = []
cmdclass = {}
if _want_cuda():
    ext_modules = [_cuda_extension(), *_low_latency_extensions(), _fp8_extension()]
    if os.environ.get("MOE_EP_BUILD_MODULES"):
        chosen = os.environ["MOE_EP_BUILD_MODULES"].split(",")
        unknown = sorted(set(chosen) - set(_MODULES))
        if unknown:
            sys.exit(f"MOE_EP_BUILD_MODULES: unknown module(s) {unknown}; choose from {sorted(_MODULES)}")
        ext_modules = [ext for ext in ext_modules if ext.name in chosen]
    cmdclass = {"build_ext": _build_ext_command()}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
