"""How the CUTLASS baselines here are built (no torch: nvcc and CUTLASS's headers alone), shared by
the benchmark that loads them (bench/bench_cutlass_conv2d_sigmoid_sum.py) and CI's compile check
(tools/check_cuda_compile.py)."""
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# CUTLASS's wgmma and TMA kernels need sm_90a
NVCC_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "-O3"]
CUTLASS_VERSION = "4.2.0.0"  # (the Makefile's pin)


def include_dirs() -> list[str]:
    """CUTLASS's and its tools' headers, from the installed nvidia-cutlass wheel (cutlass_library)."""
    try:
        import cutlass_library
    except ImportError:
        sys.exit(f"the CUTLASS baselines need CUTLASS's headers: pip install --no-deps nvidia-cutlass=={CUTLASS_VERSION}")
    source = os.path.join(os.path.dirname(cutlass_library.__file__), "source")
    dirs = [os.path.join(source, "include"), os.path.join(source, "tools", "util", "include")]
    if not os.path.exists(os.path.join(dirs[0], "cutlass", "cutlass.h")):
        sys.exit(f"cutlass_library has no CUTLASS headers under {dirs[0]}")
    return dirs


def find_nvcc() -> str:
    return os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"


def build_library(source: str) -> str:
    """build/lib<source's name>.so beside it, by nvcc where it is missing or older than `source` or
    a header here."""
    name = os.path.splitext(os.path.basename(source))[0]
    library = os.path.join(HERE, "build", f"lib{name}.so")
    inputs = [source, *[os.path.join(HERE, f) for f in os.listdir(HERE) if f.endswith(".h")]]
    if os.path.exists(library) and os.path.getmtime(library) >= max(map(os.path.getmtime, inputs)):
        return library
    os.makedirs(os.path.dirname(library), exist_ok=True)
    command = [find_nvcc(), "-shared", "-Xcompiler=-fPIC", *NVCC_FLAGS, *[f"-I{d}" for d in include_dirs()],
               source, "-o", library]
    began = time.perf_counter()
    subprocess.run(command, check=True)
    print(f"{os.path.basename(library)} built in {time.perf_counter() - began:.0f} s", flush=True)
    return library
