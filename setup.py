# Builds fused_ops._C ahead of time: CUDAExtension (CPU and CUDA kernels) where
# torch has CUDA and nvcc is found, CppExtension (CPU kernels) otherwise.
# FUSED_OPS_BUILD=cuda or =cpu forces either; =auto (the default) chooses.
# A CUDA build for sm_90 takes CUTLASS's headers where it finds them
# (cutlass_root: FUSED_OPS_CUTLASS_DIR, third_party/cutlass from `make cutlass`,
# the installed nvidia-cutlass wheel) for conv_transpose3d_weight_grad's Hopper
# kernels, and builds without them (that op then takes cuDNN's) where it does not.
#
#   pip install --no-build-isolation .
import glob
import os
import subprocess
import sys

import torch
from setuptools import find_packages, setup
from torch.utils.cpp_extension import (
    CUDA_HOME,
    BuildExtension,
    CppExtension,
    CUDAExtension,
    _get_cuda_arch_flags,
    include_paths,
)

ROOT = os.path.dirname(os.path.abspath(__file__))


def build_with_cuda() -> bool:
    mode = os.environ.get("FUSED_OPS_BUILD", "auto").lower()
    cuda_found = torch.version.cuda is not None and CUDA_HOME is not None
    if mode == "cpu":
        return False
    if mode == "cuda":
        if not cuda_found:
            raise RuntimeError(
                "FUSED_OPS_BUILD=cuda, but "
                + ("this torch has no CUDA" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)")
            )
        return True
    if mode != "auto":
        raise RuntimeError(f"FUSED_OPS_BUILD must be auto, cpu or cuda, got {mode!r}")
    return cuda_found


def shared_libstdcxx() -> list[str]:
    """The shared C++ runtime, named on the link line ahead of anything the
    toolchain adds. Seen on the GPU test image: without it the extension came out
    carrying a static copy of libstdc++'s internals beside libtorch's shared one,
    and crashed (flakily) formatting torch's error messages; with it, every C++
    runtime symbol resolves to the shared library."""
    if sys.platform != "linux":
        return []
    cxx = os.environ.get("CXX", "c++")
    try:
        path = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return []
    return [path] if os.path.isabs(path) else []


def cpu_vector_flags() -> list[str]:
    """The instruction set the CPU kernels' at::vec::Vectorized code is compiled for.
    FUSED_OPS_CPU_VEC=avx2 (AVX2 and FMA: 8 float lanes), =default (PyTorch's portable
    Vectorized: plain loops over 8 lanes), or =auto (the default): avx2 where the building
    machine is an x86-64 Linux one with AVX2 and FMA (the extension is built where it runs:
    pip install from source), default otherwise. A build for avx2 does not load on a CPU without it."""
    mode = os.environ.get("FUSED_OPS_CPU_VEC", "auto").lower()
    if mode not in ("auto", "avx2", "default"):
        raise RuntimeError(f"FUSED_OPS_CPU_VEC must be auto, avx2 or default, got {mode!r}")
    if mode == "auto":
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        mode = "avx2" if {"avx2", "fma"} <= set(flags) else "default"
    if mode == "avx2":
        # ATen's vec headers pick their AVX2 Vectorized by these macros (PyTorch builds its own
        # kernels once per CPU capability in namespace at::vec::<CAPABILITY>)
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return []


def cuda_arch_flags() -> tuple[list[str], bool]:
    """The -gencode flags torch would build for (TORCH_CUDA_ARCH_LIST, else the visible GPUs' archi-
    tectures), sm_90 as sm_90a, and whether they hold sm_90a. The CUTLASS kernels' wgmma and TMA
    need sm_90a; the other kernels compile to the same code for either, so no file is compiled for
    an architecture more (nvcc's flags are one list for every file). A compute_90 PTX stays as it is."""
    flags = [f.replace("compute_90,code=sm_90", "compute_90a,code=sm_90a") for f in _get_cuda_arch_flags()]
    return sorted(set(flags)), "-gencode=arch=compute_90a,code=sm_90a" in flags


# CUTLASS's headers within its tree, and its tools' (the conv collectives include cutlass/util/)
CUTLASS_INCLUDES = ("include", os.path.join("tools", "util", "include"))


def cutlass_root() -> str | None:
    """A CUTLASS tree (CUTLASS_INCLUDES in it): $FUSED_OPS_CUTLASS_DIR (an error where it has
    none), else third_party/cutlass (`make cutlass` copies the pinned wheel's there), else the
    installed nvidia-cutlass wheel's (cutlass_library/source); None without any."""
    def has_headers(root: str) -> bool:
        return all(os.path.isdir(os.path.join(root, d, "cutlass")) for d in CUTLASS_INCLUDES)
    explicit = os.environ.get("FUSED_OPS_CUTLASS_DIR")
    if explicit:
        if not has_headers(explicit):
            raise RuntimeError(f"FUSED_OPS_CUTLASS_DIR={explicit} lacks CUTLASS's {' or '.join(CUTLASS_INCLUDES)}")
        return explicit
    candidates = [os.path.join(ROOT, "third_party", "cutlass")]
    try:
        import cutlass_library
        candidates.append(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))
    except ImportError:
        pass
    return next((c for c in candidates if has_headers(c)), None)


def cutlass_nvcc_flags(root: str) -> list[str]:
    """nvcc's flags for the CUDA sources with CUTLASS (the tree at root)."""
    return ["-DFUSED_OPS_CUTLASS", *[f"-I{os.path.join(root, d)}" for d in CUTLASS_INCLUDES]]


def sources(pattern: str) -> list[str]:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "csrc", pattern)))


def extension():
    # No -std flag: torch's build helpers pass the standard its own headers and ABI need.
    # -fopenmp: at::parallel_for runs on torch's threads only in code compiled with OpenMP
    # (without it the CPU kernels ran on one thread).
    openmp = ["-fopenmp"] if sys.platform == "linux" else []
    # torch's headers as system headers (a directory given by -isystem and -I is searched as a system one):
    # their warnings (#pragma unroll in ATen/cpu/vec for gcc) are torch's, not ours, and would hide ours
    system = [flag for path in include_paths() for flag in ("-isystem", path)]
    # gcc 13 warns (false positives: array-bounds, then stringop-overflow) in libstdc++'s vector<bool>::reserve
    # as inlined from torch::autograd::Function::apply into each autograd/*.cpp, past -isystem (after inlining)
    cxx = ["-O3", *openmp, *cpu_vector_flags(), *system, "-Wno-array-bounds", "-Wno-stringop-overflow"]
    srcs = sources("*.cpp") + sources("autograd/*.cpp") + sources("autocast/*.cpp") + sources("cpu/*.cpp")
    if build_with_cuda():
        arch, sm90a = cuda_arch_flags()
        nvcc = ["-O3", "--expt-relaxed-constexpr", "-lineinfo", *arch, *system]
        cutlass = cutlass_root() if sm90a else None
        if cutlass is not None:
            nvcc += cutlass_nvcc_flags(cutlass)
        elif sm90a:
            print("fused_ops: no CUTLASS headers found (make cutlass, or FUSED_OPS_CUTLASS_DIR): "
                  "conv_transpose3d_weight_grad takes cuDNN's weight gradient", file=sys.stderr)
        return CUDAExtension(
            "fused_ops._C",
            srcs + sources("cuda/*.cu"),
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=[*openmp, *shared_libstdcxx()],
        )
    return CppExtension("fused_ops._C", srcs, extra_compile_args={"cxx": cxx},
                        extra_link_args=[*openmp, *shared_libstdcxx()])


if __name__ == "__main__":  # (tools/check_cuda_compile.py imports the functions above)
    setup(
        name="fused_ops",
        version="0.1.0",
        description="Fused pooling/normalization/activation/reduction tails for convolutional networks",
        packages=find_packages(include=["fused_ops", "fused_ops.*"]),
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension},
        python_requires=">=3.10",
        install_requires=["torch>=2.4"],
        extras_require={"chart": ["matplotlib"]},  # python -m fused_ops draws its chart with it, else skips it
        entry_points={"console_scripts": ["fused-ops = fused_ops.cli:main"]},
    )
