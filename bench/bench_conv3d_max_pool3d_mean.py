"""conv3d_max_pool3d_mean (architecture A's convolution and tail in one tensor-core kernel) at
SPEC's sizes, float32 input with PyTorch's default TF32 convolutions and under bfloat16
autocast: the op against cuDNN's convolution then the fused tail (max_pool3d_mean), and
architecture A's eval forward by each formulation against the original eager, in one run
(interleaved rounds, CUDA events). Prints the achieved TFLOP/s of the convolution and GB/s of
the input read once, and the error of each against the float64 result. Then the training step
(forward, and the parameters' gradients; x needs none) the same way.

    python bench/bench_conv3d_max_pool3d_mean.py [--batch 128] [--rounds 5]
"""
import argparse
import statistics

import torch
import torch.nn.functional as F

from fused_ops import conv3d_max_pool3d_mean, max_pool3d_mean, reference
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
    original = reference.Conv3dDivMaxPoolGAPBiasSum(8, 16, 3, 2.0, (2, 2, 2), (16, 1, 1, 1), 1).to(device).eval()
    fused = fnn.Conv3dDivMaxPoolGAPBiasSum.from_module(original)
    x = torch.rand(args.batch, 8, 16, 64, 64, device=device)
    weight, bias = original.conv.weight.detach(), original.conv.bias.detach()
    with torch.no_grad():
        expected = original.double()(x.double())
        original.float()

    def cudnn_then_tail():
        return max_pool3d_mean(F.conv3d(x, weight, bias), 2, divisor=2.0)

    float32 = {"op": lambda: conv3d_max_pool3d_mean(x, weight, bias, 0, 2, 2.0),
               "cuDNN + tail": cudnn_then_tail,
               "A fused_conv": forced_call(fused, x, "fused_conv"),
               "A rewrite": forced_call(fused, x, "rewrite"),
               "A original": lambda: original(x)}
    calls, settings = with_bf16_autocast(float32)  # (and the same under bfloat16 autocast)

    flop = 2 * args.batch * 14 * 62 * 62 * 16 * 8 * 27
    read = x.numel() * x.element_size()
    copy = copy_bandwidth_gbs(device, 1 << 28)
    print(f"{device_name(device)}; x {tuple(x.shape)} float32, TF32 {torch.backends.cudnn.allow_tf32}; "
          f"convolution {flop / 1e9:.1f} GFLOP, input {read / 1e6:.0f} MB; copy {copy:.0f} GB/s")
    module_names = {name for name in calls if name.startswith("A ")}
    with torch.no_grad():
        errors = {}
        for name, call in calls.items():
            with settings(name):
                out = call().double()
            reference_out = expected if name in module_names else None
            if reference_out is None:  # the op's (N, O) mean: compare through the module's bias and sum
                out = (out.view(*out.shape, 1, 1, 1) + original.bias.double()).sum(dim=1)
                reference_out = expected
            errors[name] = ((out - reference_out).abs() / reference_out.abs()).max().item()
        times = interleaved_medians(calls, device, {name: 20 for name in calls}, args.rounds, settings)
    print_convolution_table(times, errors, flop, read, 18)

    # training steps: the op on leaf parameters, and the module (original's parameters)
    original.train()
    fused.train()
    weight_leaf, bias_leaf = weight.clone().requires_grad_(), bias.clone().requires_grad_()
    grad = torch.rand(args.batch, 16, device=device)

    def op_step():
        conv3d_max_pool3d_mean(x, weight_leaf, bias_leaf, 0, 2, 2.0).backward(grad)

    grad_out = grad[:, :1].reshape(args.batch, 1, 1, 1)  # (the module's output: (N, 1, 1, 1))
    train32 = {"op": op_step, "A fused_conv": module_training_step(fused, x, grad_out, "fused_conv"),
               "A rewrite": module_training_step(fused, x, grad_out, "rewrite"),
               "A original": module_training_step(original, x, grad_out)}
    train, _ = with_bf16_autocast(train32)
    times = interleaved_medians(train, device, {name: 10 for name in train}, args.rounds, settings)
    print(f"\ntraining step (forward + the parameters' gradients), {device_name(device)}")
    print(f"{'variant':<18}{'ms':>8}")
    for name, rounds in times.items():
        print(f"{name:<18}{statistics.median(rounds):>8.3f}")


if __name__ == "__main__":
    main()
