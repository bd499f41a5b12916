"""Where a kernel's instructions come from, without a GPU: nvcc compiles FILE.cu for sm_90a as
tools/check_cuda_compile.py does (csrc's flags, CUTLASS's headers, csrc/cuda on the include path) with
-lineinfo, nvdisasm lists the SASS of each kernel whose name matches --kernel with the source line of each
instruction, and this prints each such kernel's static instruction count, its opcodes, and the source
lines with the most instructions (file, line, their top opcodes).

Static counts are what a GPU executes per pass of straight-line code: in a fully unrolled tile body (the
wgmma kernels' consumers) they are the instructions a warp issues per tile, spin loops (barrier waits)
and other loops aside. ncu's dynamic counts (Nsight Compute, on the GPU) weigh them by what runs.

Needs CUDA's cuobjdump and nvdisasm: on the PATH, beside nvcc, or from PyPI's wheels
(`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`).

    python tools/sass_lines.py FILE.cu [--kernel REGEX] [--top 25]
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import check_cuda_compile as check

FILE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)")
FUNCTION = re.compile(r"\s*\.text\.(\S+):")


def find_tool(name: str, nvcc: str) -> str:
    """CUDA's `name` (cuobjdump, nvdisasm): on the PATH, beside nvcc, or in PyPI's nvidia-cuda-* wheel."""
    found = shutil.which(name) or shutil.which(name, path=os.path.dirname(os.path.realpath(nvcc)))
    if found is None:
        for root in sys.path:
            found = next(iter(glob.glob(os.path.join(root, "nvidia", "cu*", "bin", name))), None)
            if found:
                break
    if found is None:
        sys.exit(f"sass_lines: no {name}: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    return found


def kernels_by_line(sass: str, kernel: re.Pattern) -> dict[str, list[tuple[tuple[str, int], str]]]:
    """{kernel: [((file, line), opcode) for each instruction]} of the kernels whose names match."""
    kernels, current, source = {}, None, ("?", 0)
    for text in sass.splitlines():
        function = FUNCTION.match(text)
        if function:
            current = function.group(1) if kernel.search(function.group(1)) else None
            if current:
                kernels[current], source = [], ("?", 0)
            continue
        where = FILE_LINE.search(text)
        if where:
            source = (os.path.basename(where.group(1)), int(where.group(2)))
            continue
        instruction = INSTRUCTION.match(text)
        if current and instruction:
            kernels[current].append((source, instruction.group(1)))
    return kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="the .cu file (csrc/cuda/ or bench/extensions/)")
    parser.add_argument("--kernel", default=".", help="a regex on the kernels' (mangled) names")
    parser.add_argument("--top", type=int, default=25, help="source lines shown per kernel")
    parser.add_argument("--nvcc")
    args = parser.parse_args()
    nvcc = check.cutlass_build.find_nvcc(args.nvcc)
    cuobjdump, nvdisasm = find_tool("cuobjdump", nvcc), find_tool("nvdisasm", nvcc)
    with tempfile.TemporaryDirectory() as work:
        arch, cutlass = check.csrc_flags()
        obj = os.path.join(work, "kernel.o")
        check.compile_object(nvcc, args.source, obj, [*arch, *cutlass, *check.torch_flags(work), "-lineinfo",
                                                      f"-I{os.path.join(check.ROOT, 'csrc', 'cuda')}"])
        subprocess.run([cuobjdump, "-xelf", "all", obj], cwd=work, check=True, stdout=subprocess.DEVNULL)
        cubins = glob.glob(os.path.join(work, "*sm_90a*.cubin"))
        if not cubins:
            sys.exit("sass_lines: no sm_90a cubin in the object")
        sass = subprocess.run([nvdisasm, "-g", "-c", cubins[0]], check=True, capture_output=True, text=True).stdout
    kernels = kernels_by_line(sass, re.compile(args.kernel))
    if not kernels:
        sys.exit(f"sass_lines: no kernel matches {args.kernel!r}")
    for name, instructions in kernels.items():
        opcodes = collections.Counter(opcode for _, opcode in instructions)
        print(f"\n{name}: {len(instructions)} instructions; "
              + ", ".join(f"{op} {n}" for op, n in opcodes.most_common(12)))
        per_line = collections.defaultdict(collections.Counter)
        for where, opcode in instructions:
            per_line[where][opcode] += 1
        for (file, line), counts in sorted(per_line.items(), key=lambda item: -item[1].total())[:args.top]:
            top = ", ".join(f"{op} {n}" for op, n in counts.most_common(4))
            print(f"  {counts.total():6d}  {file}:{line}  ({top})")


if __name__ == "__main__":
    main()
