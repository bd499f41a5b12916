"""conv2d_sigmoid_sum (architecture C's pool-folded convolution and tail in one tensor-core
kernel) at SPEC's sizes, float32 input with PyTorch's default TF32 convolutions and under
bfloat16 autocast: the op against the same folded convolution by cuDNN then PyTorch's sigmoid
and sum, and architecture C's eval forward by each formulation against the original eager, in
one run (interleaved rounds, CUDA events). Prints the achieved TFLOP/s of the convolution and
GB/s of the input read once, and the error of each against the float64 result. Then the
training step (forward, and the parameters' gradients; x needs none) the same way: the op
(its forward saving sigmoid', the weight-gradient kernel) and C by each formulation.

    python bench/bench_conv2d_sigmoid_sum.py [--batch 128] [--rounds 5]

(TFLOP/s of a training step: the forward's convolution and the weight gradient's GEMM, 2 x 42.6
GFLOP at SPEC's sizes.)
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from fused_ops import box_fold2d, conv2d_sigmoid_sum, reference
from fused_ops import nn as fnn
from timing import (copy_bandwidth_gbs, device_name, forced_call, interleaved_medians, module_training_step,
                    print_convolution_table, with_bf16_autocast)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    original = reference.Conv2dAvgPoolSigmoidSum(8, 64, 3, 4).to(device).eval()
    fused = fnn.Conv2dAvgPoolSigmoidSum.from_module(original)
    x = torch.rand(args.batch, 8, 384, 384, device=device)
    weight = box_fold2d(original.conv.weight.detach(), (4, 4), 16)
    bias = original.conv.bias.detach()
    with torch.no_grad():
        expected = original.double()(x.double())
        original.float()

    float32 = {"op": lambda: conv2d_sigmoid_sum(x, weight, bias, 4, 0),
               "folded cuDNN": lambda: torch.sigmoid(F.conv2d(x, weight, bias, 4)).sum(dim=(1, 2, 3)),
               "C fused_conv": forced_call(fused, x, "fused_conv"),
               "C rewrite": forced_call(fused, x, "rewrite"),
               "C original": lambda: original(x)}
    calls, settings = with_bf16_autocast(float32)  # (and the same under bfloat16 autocast)

    flop = 2 * args.batch * 95 * 95 * 64 * 8 * 36
    read = x.numel() * x.element_size()
    copy = copy_bandwidth_gbs(device, 1 << 28)
    print(f"{device_name(device)}; x {tuple(x.shape)} float32, TF32 {torch.backends.cudnn.allow_tf32}; "
          f"convolution {flop / 1e9:.1f} GFLOP, input {read / 1e6:.0f} MB; copy {copy:.0f} GB/s")
    with torch.no_grad():
        errors = {}
        for name, call in calls.items():
            with settings(name):
                errors[name] = ((call().double() - expected).abs() / expected.abs()).max().item()
        times = interleaved_medians(calls, device, {name: 20 for name in calls}, args.rounds, settings)
    print_convolution_table(times, errors, flop, read, 14)

    # training steps: the op on leaf parameters (the folded kernel), and the module (original's parameters)
    original.train()
    fused.train()
    weight_leaf, bias_leaf = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    grad = torch.rand(args.batch, device=device)

    def op_step():
        conv2d_sigmoid_sum(x, weight_leaf, bias_leaf, 4, 0).backward(grad)

    train32 = {"op": op_step, "C fused_conv": module_training_step(fused, x, grad, "fused_conv"),
               "C rewrite": module_training_step(fused, x, grad, "rewrite"),
               "C original": module_training_step(original, x, grad)}
    train, _ = with_bf16_autocast(train32)
    times = interleaved_medians(train, device, {name: 10 for name in train}, args.rounds, settings)
    print(f"\ntraining step (forward + the parameters' gradients), {device_name(device)}")
    print(f"{'variant':<14}{'ms':>8}{'TFLOP/s':>9}")
    for name, rounds in times.items():
        ms = statistics.median(rounds)
        print(f"{name:<14}{ms:>8.3f}{2 * flop / ms / 1e9:>9.0f}")


if __name__ == "__main__":
    main()
