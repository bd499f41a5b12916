"""Compile-checks the CUDA sources with nvcc, against the installed torch's headers (a CPU wheel
will do: it lacks one generated header, c10/cuda/impl/cuda_cmake_macros.h, which a stub on this
check's own include path provides). Builds nothing that is installed; exits non-zero on the first
failure. Two passes:

  csrc     every csrc/cuda/*.cu with the flags setup.py builds them with for sm_90 (TORCH_CUDA_ARCH_LIST=9.0:
           sm_90a, CUTLASS's headers, FUSED_OPS_CUTLASS), then the objects linked together (no
           symbol defined twice); a file that uses CUTLASS also without it, for sm_90 (a build
           for other architectures or without CUTLASS's headers). CUTLASS's headers as setup.py
           finds them (FUSED_OPS_CUTLASS_DIR, third_party/cutlass, the nvidia-cutlass wheel);
           this pass fails without them;
  cutlass  every bench/cutlass/*.cu (the CUTLASS baselines the benchmarks build on their own, no
           torch headers: the benchmark's flags) for sm_90a, with CUTLASS's headers where the
           csrc pass finds them (this pass fails without them), each on its own (no link); and every
           bench/extensions/*.cu (torch extensions a benchmark builds, on csrc/cuda's headers) with the
           csrc pass's flags, each on its own.

A kernel whose wgmma ptxas serializes (warning C7510: a function call in the kernel, such as a
live assert) fails either pass, and so does any other warning of ours (naming csrc/, bench/cutlass/,
bench/extensions/ or a fused_ops function) but the known register spills (KNOWN_SPILLS: counted, not
printed), so that a new one stands out.

    python tools/check_cuda_compile.py [--nvcc PATH] [FILE.cu ...]   (default: every one)

Named files go to the pass of their directory (bench/cutlass/ and bench/extensions/ to the cutlass pass).
"""
import argparse
import collections
import glob
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time

from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUTLASS_DIR = os.path.join(ROOT, "bench", "cutlass")
EXTENSIONS_DIR = os.path.join(ROOT, "bench", "extensions")
sys.path.insert(0, CUTLASS_DIR)
sys.path.insert(0, ROOT)
import cutlass_build  # noqa: E402  (how bench/cutlass/ builds its libraries; nvcc found)
import setup  # noqa: E402  (the extension's build: its architectures' flags, CUTLASS's headers)
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"
# The register spills ptxas reports (with -warn-spills) for kernels of ours, known and left as they are
# (8-104 bytes each; loop-carried values stored at 40-48 registers, not pressure), their cost measured on an
# H200 by bench/spills.py (session 26; docs/design.md): depth_stacked_channels_last's 16-bit and float64
# instantiations (local loads and stores 0.6-0.7 % of their instructions), two of batch_norm_gap's float16
# ones (its vectors of 4 and 2 channels: under 0.02 %, no slower than bfloat16's), three of
# avg_pool2d_sigmoid_sum's backward (float32's: 8448 local stores in 978 M instructions), four of
# max_pool3d_cascade_sum's float64 ones (its tiled picks 88 and 104 bytes: a reference dtype).
KNOWN_SPILLS = re.compile(r"Registers are spilled to local memory in function '\S*("
                          r"depth_stack_kernel|grad_x_channels_last_kernel|plane_moments_channels_last_kernel"
                          r"|avg_pool2d_sigmoid_sum_cu_\w*backward(_aligned_runs)?_kernel"
                          r"|max_pool3d_cascade_sum_cu_\w*(aligned_tiled_gather|tiled_pick)_kernel)I")
# A warning line of ours: in our sources, or about a function of our namespace (ptxas names them mangled).
OURS = re.compile("|".join([re.escape(os.path.join(ROOT, "csrc")), re.escape(CUTLASS_DIR), re.escape(EXTENSIONS_DIR),
                            "_ZN9fused_ops"]))


def new_warnings(output: str) -> tuple[list[str], int]:
    """nvcc's warning lines about our code less the known spills, and the number of known spills."""
    warnings = [line for line in output.splitlines() if "warning" in line.lower() and OURS.search(line)]
    fresh = [line for line in warnings if not KNOWN_SPILLS.search(line)]
    return fresh, len(warnings) - len(fresh)


def csrc_flags() -> tuple[list[str], list[str]]:
    """setup.py's nvcc flags for an sm_90 build: its -gencode flags, and CUTLASS's define and headers."""
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
    arch, sm90a = setup.cuda_arch_flags()
    cutlass = setup.cutlass_root()
    if not sm90a or cutlass is None:
        sys.exit(f"check_cuda_compile: the csrc pass needs CUTLASS's headers: make cutlass (or pip install --no-deps "
                 f"nvidia-cutlass=={cutlass_build.CUTLASS_VERSION}, or FUSED_OPS_CUTLASS_DIR)")
    return arch, setup.cutlass_nvcc_flags(cutlass)


def torch_flags(stub: str) -> list[str]:
    """nvcc's flags for a file on torch's headers (a CPU wheel's will do), as an extension builds it: torch's and
    Python's headers as system headers (their warnings under this check's C++17, torch 2.13's C++20 bit-field
    initializers in AutogradState.h, are not ours, and would hide a new one of ours), and in directory `stub`
    the generated header a CPU wheel lacks."""
    os.makedirs(os.path.join(stub, "c10", "cuda", "impl"), exist_ok=True)
    with open(os.path.join(stub, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w") as f:
        f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [f"-isystem={p}" for p in [*include_paths(), sysconfig.get_paths()["include"], stub]]
    return ["-DTORCH_EXTENSION_NAME=_C", *COMMON_NVCC_FLAGS, *includes]


def compile_object(nvcc: str, src: str, obj: str, flags: list[str]) -> int:
    """nvcc -c src -o obj, its output echoed (the known spills counted instead) with the time it took;
    exits on failure, or where ptxas serialized a kernel's wgmma. Returns its new warnings' count."""
    # C++17: what torch 2.11 (on the GPU machines) builds extensions with; newer torch uses C++20
    cmd = [nvcc, "-std=c++17", "-O3", "-Xcompiler=-fPIC", "-Xptxas=-warn-spills", "-c", src, "-o", obj, *flags]
    print("nvcc", os.path.relpath(src, ROOT), flush=True)
    began = time.perf_counter()
    result = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.writelines(line + "\n" for line in result.stdout.splitlines() if not KNOWN_SPILLS.search(line))
    fresh, known = new_warnings(result.stdout)
    print(f"  ({time.perf_counter() - began:.0f} s{f'; {known} known register spills' if known else ''})", flush=True)
    if result.returncode != 0:
        sys.exit(f"check_cuda_compile: {os.path.relpath(src, ROOT)} failed to compile")
    if WGMMA_SERIALIZED in result.stdout:
        sys.exit(f"check_cuda_compile: {os.path.relpath(src, ROOT)}: ptxas serialized a kernel's wgmma (C7510, above)")
    return len(fresh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvcc")
    parser.add_argument("sources", nargs="*",
                        help="the .cu files to check (default: every csrc/cuda/*.cu and bench/cutlass/*.cu)")
    args = parser.parse_args()
    nvcc = cutlass_build.find_nvcc(args.nvcc)
    if args.sources:
        named = [os.path.abspath(p) for p in args.sources]
        cutlass_sources = [p for p in named if os.path.dirname(p) == CUTLASS_DIR]
        extension_sources = [p for p in named if os.path.dirname(p) == EXTENSIONS_DIR]
        sources = [p for p in named if p not in cutlass_sources and p not in extension_sources]
    else:
        sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
        cutlass_sources = sorted(glob.glob(os.path.join(CUTLASS_DIR, "*.cu")))
        extension_sources = sorted(glob.glob(os.path.join(EXTENSIONS_DIR, "*.cu")))
    cutlass_includes = [f"-I{p}" for p in cutlass_build.include_dirs()] if cutlass_sources else []
    warned = collections.Counter()  # (each file's new warnings of ours: the check fails at its end on any)
    with tempfile.TemporaryDirectory() as stub:
        objects = []
        extension_flags = torch_flags(stub)
        arch, cutlass = csrc_flags() if sources or extension_sources else ([], [])
        for src in sources:
            objects.append(os.path.join(stub, f"{len(objects)}.o"))
            warned[src] += compile_object(nvcc, src, objects[-1], [*arch, *cutlass, *extension_flags])
            with open(src) as f:
                if "FUSED_OPS_CUTLASS" in f.read():
                    print("  (without CUTLASS)")
                    warned[src] += compile_object(nvcc, src, os.path.join(stub, "without_cutlass.o"),
                                                  ["-arch=sm_90", *extension_flags])
        if objects:
            # the objects link into one library (torch's symbols left unresolved): no symbol defined twice,
            # as a non-template kernel in a header shared by two files would be
            result = subprocess.run([nvcc, "-shared", *arch, *objects, "-o", os.path.join(stub, "link.so")])
            if result.returncode != 0:
                sys.exit("check_cuda_compile: the objects do not link together")
            print(f"check_cuda_compile: {len(sources)} file(s) compiled for sm_90a (with CUTLASS) and linked together")

        for i, src in enumerate(cutlass_sources):
            # the flags its library is built with (no torch)
            warned[src] += compile_object(nvcc, src, os.path.join(stub, f"cutlass{i}.o"),
                                          [*cutlass_build.NVCC_FLAGS, *cutlass_includes])
        if cutlass_sources:
            print(f"check_cuda_compile: {len(cutlass_sources)} CUTLASS file(s) compiled for sm_90a")
        for i, src in enumerate(extension_sources):
            # (as the benchmark builds it: csrc's flags, csrc/cuda's headers)
            warned[src] += compile_object(nvcc, src, os.path.join(stub, f"extension{i}.o"),
                                          [*arch, *cutlass, *extension_flags, f"-I{os.path.join(ROOT, 'csrc', 'cuda')}"])
        if extension_sources:
            print(f"check_cuda_compile: {len(extension_sources)} benchmark extension(s) compiled for sm_90a")
    if any(warned.values()):
        counts = ", ".join(f"{os.path.relpath(src, ROOT)}: {n}" for src, n in warned.items() if n)
        sys.exit(f"check_cuda_compile: new warnings of ours (above): {counts}")


if __name__ == "__main__":
    main()
