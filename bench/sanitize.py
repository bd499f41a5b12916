"""Every fused op's CUDA kernels once on small, odd-sized inputs — forwards with each result
dtype, backwards — for NVIDIA's compute-sanitizer, which CI cannot run:

    compute-sanitizer --tool memcheck --error-exitcode 1 python bench/sanitize.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python bench/sanitize.py

Prints one line per op; any sanitizer report fails the command.
"""
import torch

import fused_ops
from fused_ops.ops._common import _expand

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # (on a CPU: a dry run of the script)


def rand(*shape, dtype=torch.float32):
    return torch.rand(shape, device=DEV, dtype=dtype)


def run(name, forward, *inputs):
    """forward(*inputs, dtype=...) for each result dtype, then its backward."""
    for dtype in (None, torch.float32):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = forward(*leaves, dtype=dtype)
        out.backward(torch.rand_like(out))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print(f"{name}: ok")


def main():
    for dtype in (torch.float32, torch.bfloat16):
        run(f"avg_pool2d_sigmoid_sum {dtype}", lambda x, dtype: fused_ops.avg_pool2d_sigmoid_sum(x, 3, dtype=dtype),
            rand(2, 3, 13, 11, dtype=dtype))
        run(f"max_pool3d_mean {dtype}", lambda x, dtype: fused_ops.max_pool3d_mean(x, 2, divisor=-1.5, dtype=dtype),
            rand(2, 3, 5, 7, 9, dtype=dtype))
        run(f"max_pool3d_cascade_sum {dtype}",
            lambda x, dtype: fused_ops.max_pool3d_cascade_sum(x, 2, 3, dtype=dtype), rand(2, 3, 13, 14, 15, dtype=dtype))
        run(f"parity_max_pool3d_mean {dtype}", lambda y, dtype: fused_ops.parity_max_pool3d_mean(y, dtype=dtype),
            rand(2, 3, 4, 5, 3, 8, dtype=dtype))
        run(f"parity_max_pool3d_cascade_sum {dtype}",
            lambda y, dtype: fused_ops.parity_max_pool3d_cascade_sum(y, 2, dtype=dtype), rand(2, 4, 5, 6, 3, 8, dtype=dtype))
        for out_dtype in (None, torch.bfloat16):  # forward only: it has no backward; the plain transpose too
            fused_ops.depth_stacked_channels_last(rand(2, 3, 7, 9, 11, dtype=dtype), 4, 2, [-1, -2, 1], [3, 12, 9],
                                                  dtype=out_dtype)
            fused_ops.depth_stacked_channels_last(rand(2, 64, 3, 5, 24, dtype=dtype), 1, 1, 0, [3, 5, 24],
                                                  dtype=out_dtype)
            # rows (taps x channels) over two passes of a warp's staging, the second partial
            fused_ops.depth_stacked_channels_last(rand(1, 20, 5, 6, 7, dtype=dtype), 3, 1, [0, -1, 0], [3, 8, 7],
                                                  dtype=out_dtype)
        print(f"depth_stacked_channels_last {dtype}: ok")
        run(f"box_fold2d {dtype}", lambda w, dtype: fused_ops.box_fold2d(w, (4, 3), 12.0, dtype=dtype),
            rand(5, 3, 3, 2, dtype=dtype))
    # the tensor-core kernels (TF32; bf16 with x rounded): both kernel shapes, both loaders, odd rows, padding,
    # an odd channel count, more than one pass of eight channels in the weight gradient; forward alone, then
    # forward saving sigmoid' and the weight-gradient kernel (copy engine: rows of whole 16-byte chunks)
    torch.backends.cudnn.allow_tf32 = True
    for x, w, stride, padding in ((rand(2, 3, 21, 395), rand(5, 3, 6, 6), 4, 1),  # (cp.async)
                                  (rand(2, 3, 21, 396), rand(5, 3, 6, 6), 4, 1),  # (copy engine)
                                  (rand(1, 16, 13, 203), rand(64, 16, 4, 4), 2, (0, 1)),
                                  (rand(1, 19, 13, 204), rand(64, 19, 4, 4), 2, (0, 1))):
        b = rand(w.shape[0])
        for weight, bias in ((w, b), (w.bfloat16(), b.bfloat16())):  # (bfloat16: x rounded, m16n8k16)
            fused_ops.conv2d_sigmoid_sum(x, weight, bias, stride, padding)
            leaves = [weight.clone().requires_grad_(), bias.clone().requires_grad_()]
            fused_ops.conv2d_sigmoid_sum(x, *leaves, stride, padding).float().backward(torch.rand(x.shape[0], device=DEV))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv2d_sigmoid_sum: ok")
    # architecture A's kernels (TF32; bf16 with x rounded): padding with a lead column, windows past the
    # output's edge, two channel blocks, fewer than 16 outputs, a negative divisor; forward alone, then
    # forward saving the picks and the weight-gradient kernel; each without and with A's channel bias and sum;
    # a float32 weight and bias rounded to bf16 as read (operand_dtype: autocast's); SPEC's rows (8 to 16
    # channels, 64 wide): the wgmma kernel (a build with CUTLASS), D' and H' odd; then its columns of two tiles
    # sharing x planes (80 (n, row block)s on 132 SMs: both plane pairs a column); two channel blocks of 360 tasks
    # (the weight gradient's blocks each several tasks a channel block: its copies one item ahead, its sums between)
    for x, w, padding, divisor in ((rand(2, 3, 7, 11, 20), rand(5, 3, 3, 3, 3), (1, 0, 1), -1.5),
                                   (rand(1, 11, 6, 9, 72), rand(16, 11, 3, 3, 3), 0, 2.0),
                                   (rand(2, 8, 7, 9, 64), rand(16, 8, 3, 3, 3), 0, -0.7),
                                   (rand(5, 8, 6, 64, 64), rand(16, 8, 3, 3, 3), 0, 2.0),
                                   (rand(4, 11, 12, 72, 20), rand(16, 11, 3, 3, 3), 0, -0.7)):
        b, channel_bias = rand(w.shape[0]), rand(w.shape[0])
        for weight, bias, operand in ((w, b, None), (w.bfloat16(), b.bfloat16(), None), (w, b, torch.bfloat16)):
            for tail in ({}, dict(channel_bias=channel_bias, sum_channels=True)):
                tail = dict(tail, operand_dtype=operand)
                fused_ops.conv3d_max_pool3d_mean(x, weight, bias, padding, 2, divisor, **tail)
                leaves = [weight.clone().requires_grad_(), bias.clone().requires_grad_()]
                tail = {k: v.clone().requires_grad_() if k == "channel_bias" else v for k, v in tail.items()}
                out = fused_ops.conv3d_max_pool3d_mean(x, *leaves, padding, 2, divisor, **tail)
                out.float().backward(torch.rand_like(out.float()))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv3d_max_pool3d_mean: ok")
    # B's weight gradient from the cascade's picks: 33 input channels (two lane blocks; the partials
    # kernel), odd sizes, a non-finite x (the NaN pass), float64 and bfloat16 x; 36 (the window
    # kernel, two lane blocks, 9 output channels: a part-filled block) with a non-finite grad_out too
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        x = rand(2, 33, 5, 4, 6, dtype=dtype)
        x[1, 7, 2, 1, 3] = float("inf")
        picks = torch.randint(0, 8 * 27, (2, 1, 1, 1, 5), generator=g, dtype=torch.uint8).to(DEV)
        fused_ops.conv_transpose3d_cascade_weight_grad(rand(2, 1, 1, 1, 1), picks, x, 5, 2, 2, 3, [9, 7, 11])
    for dtype in (torch.float32, torch.bfloat16):
        x = rand(2, 36, 7, 6, 8, dtype=dtype)
        x[1, 7, 2, 1, 3] = float("inf")
        grad_out = rand(2, 1, 2, 1, 2)
        grad_out[0, 0, 1, 0, 1] = float("-inf")
        picks = torch.randint(0, 8 * 27, (2, 2, 1, 2, 9), generator=g, dtype=torch.uint8).to(DEV)
        fused_ops.conv_transpose3d_cascade_weight_grad(grad_out, picks, x, 5, 2, 2, 3, [13, 11, 15])
    # 4000 items (dozens a block: the window kernel's ring of stages and batches of picks wrap around)
    picks = torch.randint(0, 8 * 27, (4, 10, 10, 10, 8), generator=g, dtype=torch.uint8).to(DEV)
    fused_ops.conv_transpose3d_cascade_weight_grad(rand(4, 1, 10, 10, 10), picks, rand(4, 4, 31, 31, 31), 5, 2, 2,
                                                   3, [61, 61, 61])
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv_transpose3d_cascade_weight_grad: ok")
    # D's weight gradient: the TF32 shifted rows with ks 8 and 6 (two CTAs' shift blocks, the last loading a
    # shift again), bf16 by CUTLASS's wgrad
    for dtype in (torch.float32, torch.bfloat16):
        fused_ops.conv_transpose3d_weight_grad(rand(8, 64, 12, 9, 13, dtype=dtype), rand(8, 16, 8, 6, 6, dtype=dtype),
                                               (5, 4, 8))
    cl = torch.channels_last_3d
    fused_ops.conv_transpose3d_weight_grad(rand(8, 48, 20, 8, 15).contiguous(memory_format=cl),
                                           rand(8, 40, 16, 6, 10).contiguous(memory_format=cl), (5, 3, 6))
    # the shifted rows: ks 5 and 3, a split, partial channel tiles (I 40, O 130), rows of 76 (x's shifts
    # reaching before a row's start), from NCDHW and channels-last operands
    fused_ops.conv_transpose3d_weight_grad(rand(3, 130, 3, 4, 74), rand(3, 40, 2, 3, 70), (2, 2, 5))
    fused_ops.conv_transpose3d_weight_grad(rand(2, 36, 5, 7, 9).contiguous(memory_format=cl),
                                           rand(2, 70, 3, 5, 7).contiguous(memory_format=cl), (3, 3, 3))
    # in batch chunks (the operands' copies over grad_y's size: one batch element a chunk)
    fused_ops.conv_transpose3d_weight_grad(rand(4, 8, 9, 9, 9), rand(4, 64, 5, 5, 5), (5, 5, 5))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv_transpose3d_weight_grad: ok")
    # D's bias gradient: channels-last rows (odd channel counts: a partial tile of 32 lanes; chunks of rows), each
    # dtype, and an (N, C) matrix
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        fused_ops.channel_sums(rand(3, 37, 2, 3, 5, dtype=dtype).contiguous(memory_format=cl))
        fused_ops.channel_sums(rand(1, 64, 7, 9, 9, dtype=dtype).contiguous(memory_format=cl))
        fused_ops.channel_sums(rand(2, 130, dtype=dtype))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("channel_sums: ok")
    # D's forward: sizes that CUTLASS's TF32 and bf16 fprop kernels take (partial tiles, padding, bias or none)
    for dtype in (torch.float32, torch.bfloat16):
        for bias in (rand(136, dtype=dtype), None):
            fused_ops.conv_transpose3d_stride1_channels_last(rand(3, 24, 5, 6, 7, dtype=dtype),
                                                             rand(24, 136, 5, 4, 3, dtype=dtype), bias, (4, 1, 2))
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv_transpose3d_stride1_channels_last: ok")
    # B's forward in one kernel, bf16x3 (certified picks; integer-valued x and w: ties, every window picked
    # again), TF32 and bfloat16: an odd geometry (40 output channels, the last row tile's
    # second half and a second column tile of one outside the output, output_padding), SPEC's kernel on a
    # channels-last x, kernels of 6, 2 and 1 (few taps a class, classes of none), kernels of 3 in depth (2 taps a
    # class: slices no tap reads), with and without the picks (without: items split in parts, their maxima's kernel)
    for dtype, precision in ((torch.float32, "highest"), (torch.float32, "high"), (torch.bfloat16, "highest")):
        torch.set_float32_matmul_precision(precision)
        integers = (torch.randint(-2, 3, (1, 32, 5, 6, 7), device=DEV).to(dtype),
                    torch.randint(-2, 3, (32, 24, 5, 5, 5), device=DEV).to(dtype), 2, 0)
        for x, w, padding, output_padding in (integers,
                                              (rand(2, 32, 4, 17, 35, dtype=dtype), rand(32, 40, 5, 3, 4, dtype=dtype),
                                               (2, 1, 1), (0, 1, 1)),
                                              (rand(1, 32, 8, 8, 8, dtype=dtype).contiguous(memory_format=cl),
                                               rand(32, 64, 5, 5, 5, dtype=dtype), 2, 0),
                                              (rand(1, 32, 5, 6, 7, dtype=dtype), rand(32, 17, 6, 2, 1, dtype=dtype),
                                               (2, 0, 0), (1, 1, 0)),
                                              (rand(1, 32, 7, 8, 9, dtype=dtype), rand(32, 64, 3, 5, 5, dtype=dtype),
                                               (1, 2, 2), 0)):
            for save in (False, True):
                torch.ops.fused_ops.conv_transpose3d_cascade_sum(x, w, [2, 2, 2], _expand(padding, 3, ""),
                                                                 _expand(output_padding, 3, ""),
                                                                 [3, 3, 3], save, None)
    torch.set_float32_matmul_precision("highest")
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv_transpose3d_cascade_sum: ok")
    # D's eval forward: its map (x's sums in chunks with the tap sums, then a block per output channel), float32
    # and bfloat16 x, a non-finite x; planes of two chunks (the second partial); x channels last (PyTorch's sums);
    # x off a 16-byte boundary with planes of 105 elements (read element by element, a last group cut); planes
    # of 60 (vectors, a last group cut)
    for dtype in (torch.float32, torch.bfloat16):
        stats = (rand(7), rand(7), rand(7), rand(7) + 0.5)
        for x in (rand(3, 5, 4, 3, 2, dtype=dtype), rand(2, 5, 20, 30, 30, dtype=dtype),
                  rand(2, 5, 3, 4, 5, dtype=dtype),
                  rand(2, 5, 4, 3, 2, dtype=dtype).contiguous(memory_format=torch.channels_last_3d),
                  rand(2 * 5 * 105 + 1, dtype=dtype)[1:].view(2, 5, 3, 5, 7)):
            x[1, 2, 0, 0, 0] = float("inf")
            fused_ops.conv_transpose3d_batch_norm_eval_mean(x, rand(5, 7, 3, 2, 4, dtype=dtype), rand(7, dtype=dtype),
                                                            *stats, (2, 1, 3), (1, 0, 2), 2.0, 1e-5)
    if DEV == "cuda":
        torch.cuda.synchronize()
    print("conv_transpose3d_batch_norm_eval_mean: ok")
    for dtype in (torch.float32, torch.bfloat16):
        bn = torch.nn.BatchNorm3d(3).to(DEV)
        run(f"batch_norm_gap {dtype}", lambda x, dtype: fused_ops.batch_norm_gap(
            x, 2.0, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.num_batches_tracked, training=True,
            dtype=dtype), rand(2, 3, 4, 5, 6, dtype=dtype))
        # channels_last_3d: the channels-last kernels (2 rows of 16 lanes a warp in float32, a partial last chunk)
        bn40 = torch.nn.BatchNorm3d(40).to(DEV)
        run(f"batch_norm_gap channels_last {dtype}", lambda x, dtype: fused_ops.batch_norm_gap(
            x, 2.0, bn40.weight, bn40.bias, bn40.running_mean, bn40.running_var, bn40.num_batches_tracked,
            training=True, dtype=dtype), rand(2, 40, 7, 8, 9, dtype=dtype).contiguous(memory_format=torch.channels_last_3d))


if __name__ == "__main__":
    main()
