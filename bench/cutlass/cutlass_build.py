"""How the CUTLASS baselines here are built (no torch: nvcc and CUTLASS's headers alone), shared by
the benchmark that loads them (bench/bench_cutlass_conv2d_sigmoid_sum.py) and CI's compile check
(tools/check_cuda_compile.py)."""
import ctypes
import glob
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
import setup  # noqa: E402  (the extension's build: where CUTLASS's headers are)

# CUTLASS's wgmma and TMA kernels need sm_90a
NVCC_FLAGS = ["-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "--expt-relaxed-constexpr", "-O3"]
CUTLASS_VERSION = "4.2.0.0"  # (the Makefile's pin)


def include_dirs() -> list[str]:
    """CUTLASS's and its tools' headers where the extension's build finds them (setup.py's
    cutlass_root: FUSED_OPS_CUTLASS_DIR, third_party/cutlass from `make cutlass`, the installed
    nvidia-cutlass wheel)."""
    root = setup.cutlass_root()
    if root is None:
        sys.exit(f"the CUTLASS baselines need CUTLASS's headers: make cutlass (the pinned nvidia-cutlass=="
                 f"{CUTLASS_VERSION}), or FUSED_OPS_CUTLASS_DIR")
    return [os.path.join(root, d) for d in setup.CUTLASS_INCLUDES]


def find_nvcc(explicit: str | None = None) -> str:
    """nvcc: `explicit`, else $NVCC, else on the PATH, else the newest /usr/local/cuda*/bin/nvcc."""
    candidates = [explicit, os.environ.get("NVCC"), shutil.which("nvcc"),
                  *sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    sys.exit("nvcc not found (pass its path or set NVCC)")


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


class Library:
    """A built baseline's C interface (bench/cutlass/baseline.h): the ctypes handle, its
    variants (dicts of `fields` from <prefix>_describe, the `int_fields` as ints, "index" each
    one's), and calls that return 0 or an error message."""

    def __init__(self, path: str, prefix: str, fields: tuple[str, ...], int_fields: tuple[str, ...]):
        self.lib = ctypes.CDLL(path)
        self.prefix = prefix
        self.variants = []
        buffer = ctypes.create_string_buffer(512)
        for i in range(getattr(self.lib, f"{prefix}_variant_count")()):
            if getattr(self.lib, f"{prefix}_describe")(i, buffer, len(buffer)) != 0:
                raise RuntimeError(f"{prefix}_describe({i}) failed")
            variant = dict(zip(fields, buffer.value.decode().split(";"), strict=True))
            variant.update({key: int(variant[key]) for key in int_fields}, index=i)
            self.variants.append(variant)

    def variant(self, name: str) -> dict:
        return next(v for v in self.variants if v["name"] == name)

    def run(self, name: str, *args) -> None:
        """<prefix>_run(variant index, *args, error buffer, its size); raises with the library's message."""
        error = ctypes.create_string_buffer(512)
        if getattr(self.lib, f"{self.prefix}_run")(self.variant(name)["index"], *args, error, len(error)) != 0:
            raise RuntimeError(f"CUTLASS {name}: {error.value.decode()}")
