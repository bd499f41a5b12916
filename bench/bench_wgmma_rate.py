"""wgmma's rate at small N (bench/extensions/wgmma_rate.cu, built here as a torch extension of its own): TF32
m64nNk8 with A from registers and B from shared memory, as A's kernel issues them (N = 16 there: its tensor pipe
was 29 % busy by ncu), in batches of independent instructions with at most two batches in flight, one CTA an SM
of 1 or 2 warp groups. Per configuration: the SM cycles an instruction takes (clock64, the median CTA), the
MACs an SM does a cycle, and the TFLOP/s over the whole GPU by CUDA events. Whether a wider N (A's output planes
merged into one instruction) would run A's products faster.

    cd bench && python3 bench_wgmma_rate.py [--batches 4000]
"""
import argparse
import statistics
import sys

import torch

from timing import build_extension

CONFIGS = [(n, acc, wg) for n in (16, 32, 48, 64) for acc in (2, 4, 8) for wg in (1, 2) if n * acc <= 256]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=4000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_wgmma_rate: needs a GPU")
    rate = build_extension("wgmma_rate", "wgmma_rate.cu")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cycles = torch.zeros(sms, dtype=torch.int64, device="cuda")
    sink = torch.zeros(1, device="cuda")
    print(f"{torch.cuda.get_device_name()}, {sms} CTAs, {args.batches} batches a warp group")
    print(f"{'N':>4}{'accumulators':>14}{'warp groups':>13}{'cycles/instr':>14}{'MAC/cycle/SM':>14}{'TFLOP/s':>10}")
    for n, acc, wg in CONFIGS:
        rate.wgmma_rate(n, acc, wg, 10, cycles, sink)  # (warm-up)
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            rate.wgmma_rate(n, acc, wg, args.batches, cycles, sink)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        instructions = args.batches * acc * wg  # (an SM's)
        per_instruction = statistics.median(cycles.tolist()) / instructions
        macs = 64 * n * 8
        tflops = 2 * macs * instructions * sms / (statistics.median(times) * 1e-3) / 1e12
        print(f"{n:>4}{acc:>14}{wg:>13}{per_instruction:>14.2f}{macs / per_instruction:>14.0f}{tflops:>10.1f}")
    assert sink.item() == 0.0


if __name__ == "__main__":
    main()
