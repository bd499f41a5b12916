"""Compile-checks every csrc/cuda/*.cu for sm_90 with nvcc, against the
installed torch's headers (a CPU wheel will do: it lacks one generated
header, c10/cuda/impl/cuda_cmake_macros.h, which a stub on this check's own
include path provides), then links the objects together (no symbol defined
twice). Builds nothing that is installed; exits non-zero on the first failure.

    python tools/check_cuda_compile.py [--nvcc PATH] [FILE.cu ...]   (default: every one)
"""
import argparse
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvcc(explicit: str | None) -> str:
    candidates = [explicit, os.environ.get("NVCC"), shutil.which("nvcc"),
                  *sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    sys.exit("check_cuda_compile: nvcc not found (pass --nvcc or set NVCC)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nvcc")
    parser.add_argument("sources", nargs="*", help="the .cu files to check (default: every csrc/cuda/*.cu)")
    args = parser.parse_args()
    nvcc = find_nvcc(args.nvcc)
    sources = [os.path.abspath(p) for p in args.sources] or sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    with tempfile.TemporaryDirectory() as stub:
        os.makedirs(os.path.join(stub, "c10", "cuda", "impl"))
        with open(os.path.join(stub, "c10", "cuda", "impl", "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes = [f"-I{p}" for p in [*include_paths(), sysconfig.get_paths()["include"], stub]]
        objects = []
        for src in sources:
            objects.append(os.path.join(stub, f"{len(objects)}.o"))
            # C++17: what torch 2.11 (on the GPU machines) builds extensions with; newer torch uses C++20
            cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-Xcompiler=-fPIC", "-c", src, "-o", objects[-1],
                   "-Xptxas=-warn-spills", "-DTORCH_EXTENSION_NAME=_C", *COMMON_NVCC_FLAGS, *includes]
            print("nvcc", os.path.relpath(src, ROOT), flush=True)
            result = subprocess.run(cmd)
            if result.returncode != 0:
                sys.exit(f"check_cuda_compile: {os.path.relpath(src, ROOT)} failed to compile")
        # the objects link into one library (torch's symbols left unresolved): no symbol defined twice,
        # as a non-template kernel in a header shared by two files would be
        result = subprocess.run([nvcc, "-shared", "-arch=sm_90", *objects, "-o", os.path.join(stub, "link.so")])
        if result.returncode != 0:
            sys.exit("check_cuda_compile: the objects do not link together")
    print(f"check_cuda_compile: {len(sources)} file(s) compiled for sm_90 and linked together")


if __name__ == "__main__":
    main()
