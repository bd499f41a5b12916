"""conv_transpose3d_cascade_weight_grad (architecture B's weight gradient from the cascade's
picks) against PyTorch's dense transposed-convolution weight gradient of the same output
gradient (zero off the picks), and B's training step (forward, the parameters' gradients; x
needs none) by the rewrite with the picked and with the dense weight gradient, by the original
eager, in one run (interleaved rounds; CUDA events on a GPU). SPEC's size on a GPU, a batch of
one at 16^3 on the CPU. Float32 (TF32 convolutions by PyTorch's default) and float64 errors.

    python bench/bench_conv_transpose3d_cascade_weight_grad.py [--device cuda] [--batch 16] [--rounds 5]
"""
import argparse
import contextlib
import statistics

import torch

from fused_ops import autotune, conv_transpose3d_cascade_weight_grad, reference, rewrites
from fused_ops import nn as fnn
from timing import device_name, interleaved_medians, module_training_step

STRIDE, PADDING, KERNEL, KERNEL2 = 2, 2, 5, 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    batch, size = (args.batch or 16, 32) if device.type == "cuda" else (args.batch or 1, 16)
    torch.manual_seed(0)
    original = reference.ConvTranspose3dMaxPoolMaxPoolSum(32, 64, KERNEL, STRIDE, PADDING).to(device)
    fused = fnn.ConvTranspose3dMaxPoolMaxPoolSum.from_module(original)
    x = torch.rand(batch, 32, size, size, size, device=device)
    conv = original.conv_transpose
    found = rewrites._transposed_windows_geometry(x, conv, original.max_pool1, original.max_pool2)
    assert found is not None
    axes, positions, out_size = found
    weight = conv.weight.detach().requires_grad_()
    with torch.no_grad():
        out, picks = rewrites._cascade_sum(x, weight, [KERNEL2] * 3, axes, positions, save_picks=True)
    grad = torch.rand_like(out)

    def dense():  # PyTorch's weight gradient of the same output gradient, through the windows' convolution
        return torch.autograd.grad(rewrites._cascade_sum(x, weight, [KERNEL2] * 3, axes,
                                                         positions, save_picks=False)[0], weight, grad)[0]

    def op():
        return conv_transpose3d_cascade_weight_grad(grad, picks, x, KERNEL, STRIDE, PADDING, KERNEL2, out_size)

    expected = conv_transpose3d_cascade_weight_grad(grad.double(), picks, x.double(), KERNEL, STRIDE, PADDING,
                                                    KERNEL2, out_size)
    errors = {name: ((call().double() - expected).abs().max() / expected.abs().max()).item()
              for name, call in (("op", op), ("dense", dense))}
    step_grad = torch.rand_like(out)
    calls = {"op": op, "dense (windows' autograd)": dense,
             "B rewrite, picked": module_training_step(fused, x, step_grad, "rewrite"),
             "B rewrite, dense": module_training_step(fused, x, step_grad, "rewrite"),
             "B original": module_training_step(original, x, step_grad)}
    settings = {"B rewrite, picked": lambda: rewrites.forced_picked_weight_grad(True),
                "B rewrite, dense": lambda: rewrites.forced_picked_weight_grad(False)}
    times = interleaved_medians(calls, device, {name: 5 if device.type == "cpu" else 20 for name in calls},
                                args.rounds, lambda name: settings.get(name, contextlib.nullcontext)())
    print(f"{device_name(device)}; x {tuple(x.shape)} float32, TF32 {torch.backends.cudnn.allow_tf32}; "
          f"picks {tuple(picks.shape)}; the weight gradient's error against float64: op {errors['op']:.1e}, "
          f"dense {errors['dense']:.1e}")
    print(f"{'variant':<28}{'ms':>10}")
    for name, rounds in times.items():
        print(f"{name:<28}{statistics.median(rounds):>10.3f}")
    autotune.clear()


if __name__ == "__main__":
    main()
