"""Survey: NaN, +inf and -inf in the input (and in the parameters) through every formulation of
every drop-in module (fused_ops.nn) against the original (fused_ops.reference), eval and training.

For each module x formulation x mode x pattern: the output and the buffers (running statistics)
must be the original's (NaN where it is NaN, +-inf where it is), the gradients the original's
wherever the original's are finite. Prints one line per case that differs and a table of counts.

    PYTHONPATH=. python tools/survey_non_finite.py [--device cpu|cuda] [--dtype float64,float32] [--params]
"""
import argparse
import sys

import torch

import fused_ops  # noqa: F401
from fused_ops import autotune, reference
from fused_ops import nn as fnn

CONFIGS = [
    ("A", "Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, -1.5, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("A2", "Conv3dDivMaxPoolGAPBiasSum", (3, 4, 3, 2.0, 2, (4, 1, 1, 1), 1), (2, 3, 9, 10, 11)),
    ("B", "ConvTranspose3dMaxPoolMaxPoolSum", (3, 4, 5, 2, 2), (2, 3, 7, 6, 7)),
    ("C", "Conv2dAvgPoolSigmoidSum", (3, 5, 3, 4), (2, 3, 22, 19)),
    ("D", "ConvTranspose3dScaleBatchNormGAP", (3, 4, 3, 2.0), (3, 3, 4, 5, 6)),
]
NAN, INF = float("nan"), float("inf")


def positions(shape):
    """Named positions in x: the first element, an interior one, the last, an edge one."""
    mid = tuple([s // 2 for s in shape])
    edge = (0, shape[1] - 1, *([0] * (len(shape) - 3)), shape[-1] - 1)
    return {"first": (0,) * len(shape), "mid": (shape[0] - 1, *mid[1:]), "last": tuple([s - 1 for s in shape]),
            "edge": edge}


def input_patterns(shape):
    """(name, [(position, value), ...]) of non-finite values in x."""
    where = positions(shape)
    patterns = [(f"{vname}@{pname}", [(p, v)]) for pname, p in where.items()
                for vname, v in (("nan", NAN), ("+inf", INF), ("-inf", -INF))]
    mid = where["mid"]
    nb = (*mid[:-1], mid[-1] - 1)  # a neighbour of mid (one window, most likely)
    patterns += [
        ("nan+inf-inf", [(where["first"], NAN), (mid, INF), (where["last"], -INF)]),
        ("+inf,-inf adjacent", [(mid, INF), (nb, -INF)]),
        ("+inf,+inf adjacent", [(mid, INF), (nb, INF)]),
        ("nan,+inf adjacent", [(mid, NAN), (nb, INF)]),
        ("+inf everywhere-ch0", "plane+inf"),
        ("-inf everywhere", "all-inf"),
    ]
    return patterns


def apply_input_pattern(x, pattern):
    x = x.clone()
    if pattern == "plane+inf":
        x[:, 0] = INF
    elif pattern == "all-inf":
        x.fill_(-INF)
    else:
        for p, v in pattern:
            x[p] = v
    return x


def parameter_patterns(module):
    """(name, setter) of non-finite values in a parameter or buffer."""
    conv = getattr(module, "conv", None) or module.conv_transpose
    patterns = []
    for vname, v in (("nan", NAN), ("+inf", INF), ("-inf", -INF)):
        patterns.append((f"weight {vname}", lambda m, v=v: _conv(m).weight.data.view(-1)[0].fill_(v)))
        patterns.append((f"weight mid {vname}",
                         lambda m, v=v: _conv(m).weight.data.view(-1)[_conv(m).weight.numel() // 2].fill_(v)))
        patterns.append((f"conv bias {vname}", lambda m, v=v: _conv(m).bias.data[0].fill_(v)))
        if hasattr(module, "bias") and isinstance(module.bias, torch.nn.Parameter):
            patterns.append((f"bias {vname}", lambda m, v=v: m.bias.data.view(-1)[0].fill_(v)))
        if hasattr(module, "divisor"):
            patterns.append((f"divisor {vname}", lambda m, v=v: setattr(m, "divisor", v)))
        if hasattr(module, "scale_factor"):
            patterns.append((f"scale_factor {vname}", lambda m, v=v: setattr(m, "scale_factor", v)))
        if hasattr(module, "batch_norm"):
            for attr in ("weight", "bias", "running_mean", "running_var"):
                patterns.append((f"bn.{attr} {vname}",
                                 lambda m, v=v, attr=attr: getattr(m.batch_norm, attr).data[0].fill_(v)))
    del conv
    return patterns


def _conv(m):
    return m.conv if hasattr(m, "conv") else m.conv_transpose


def step(module, x, grad):
    module.zero_grad()
    x = x.clone().requires_grad_()
    out = module(x)
    out.backward(grad)
    return out.detach(), [x.grad, *[p.grad for p in module.parameters()]], [b.clone() for b in module.buffers()]


def same(a, e, rtol):
    """a equals e: NaN where e is NaN, the same infinities, finite values within rtol of e's scale."""
    if a is None or e is None:
        return a is None and e is None
    if not torch.equal(a.isnan(), e.isnan()) or not torch.equal(a.isposinf(), e.isposinf()) \
            or not torch.equal(a.isneginf(), e.isneginf()):
        return False
    finite = e.isfinite()
    if not finite.any():
        return True
    scale = e[finite].abs().max().item()
    return bool(((a[finite] - e[finite]).abs() <= rtol * max(scale, 1e-30) + 1e-300).all())


def largest_finite(tensors):
    return max([t[t.isfinite()].abs().max().item() for t in tensors if t is not None and t.isfinite().any()],
               default=0.0)


def same_finite_mask(a, e, rtol):
    """a is finite exactly where e is, and equals it there (NaN and an infinity may stand for each other)."""
    if not torch.equal(a.isfinite(), e.isfinite()):
        return False
    return same_where_finite(a, e, rtol, 0.0)


def same_where_finite(a, e, rtol, scale):
    """a equals e wherever e is finite, within rtol of `scale` (a parameter's gradient at the scale of
    all of them: a conv bias's before a training batch norm is rounding noise about 0)."""
    if a is None or e is None:
        return a is None and e is None
    finite = e.isfinite()
    if not finite.any():
        return True
    if not a[finite].isfinite().all():
        return False
    scale = max(scale, e[finite].abs().max().item() if scale == 0 else 0.0)
    return bool(((a[finite] - e[finite]).abs() <= rtol * max(scale, 1e-30) + 1e-300).all())


def build(name, args, device, dtype, train):
    torch.manual_seed(0)
    original = getattr(reference, name)(*args).to(device, dtype).train(train)
    fused = getattr(fnn, name).from_module(original)
    return original, fused


def copy_pair(name, args, device, dtype, train, setter):
    original, _ = build(name, args, device, dtype, train)
    torch.manual_seed(0)
    other = getattr(reference, name)(*args).to(device, dtype).train(train)
    fused = getattr(fnn, name).from_module(other)
    if setter is not None:
        setter(original)
        setter(fused)  # (the parameters shared with `other`; a plain number such as the divisor copied)
    return original, fused


def survey(device, dtypes, with_params, letters):
    rtol = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
    rows = []
    for letter, name, args, shape in CONFIGS:
        if letters and letter.rstrip("0123456789") not in letters:
            continue
        formulations = getattr(fnn, name).FORMULATIONS
        for dtype in dtypes:
            g = torch.Generator().manual_seed(1)
            base = torch.rand(shape, generator=g, dtype=torch.float64).to(device, dtype)
            cases = [(p, apply_input_pattern(base, pat), None) for p, pat in input_patterns(shape)]
            if with_params:
                _, probe = build(name, args, device, dtype, False)
                cases += [(p, base, setter) for p, setter in parameter_patterns(probe)]
            for train in (False, True):
                mode = "train" if train else "eval"
                for pattern, x, setter in cases:
                    original, _ = copy_pair(name, args, device, dtype, train, setter)
                    with torch.no_grad():
                        shape_out = original(x.clone()).shape
                    grad = torch.rand(shape_out, generator=g, dtype=torch.float64).to(device, dtype)
                    for formulation in formulations:
                        original, fused = copy_pair(name, args, device, dtype, train, setter)
                        e_out, e_grads, e_bufs = step(original, x, grad)
                        try:
                            with autotune.force(formulation):
                                a_out, a_grads, a_bufs = step(fused, x, grad)
                            ran = autotune.last_formulation()
                        except Exception as error:  # noqa: BLE001
                            rows.append((letter, formulation, mode, str(dtype)[6:], pattern, f"raised {error!r}"[:120]))
                            continue
                        problems = []
                        if not same(a_out, e_out, rtol[dtype]):
                            problems.append("out" if setter is None or not same_finite_mask(a_out, e_out, rtol[dtype])
                                            else "out(NaN for inf)")
                        if not all([same(a, e, rtol[dtype]) for a, e in zip(a_bufs, e_bufs)]):
                            problems.append("buffers" if setter is None or not all(
                                [same_finite_mask(a, e, rtol[dtype]) for a, e in zip(a_bufs, e_bufs)])
                                else "buffers(NaN for inf)")
                        names = ["x", *[n for n, _ in fused.named_parameters()]]
                        scales = [0.0] + [largest_finite(e_grads[1:])] * (len(e_grads) - 1)
                        bad = [n for n, a, e, scale in zip(names, a_grads, e_grads, scales)
                               if not same_where_finite(a, e, rtol[dtype], scale)]
                        if bad:
                            problems.append("grad(" + ",".join(bad) + ")")
                        status = " ".join(problems) if problems else "ok"
                        if ran != formulation:  # (not taken for this input: the next formulation ran)
                            status = f"{status} (ran {ran})"
                        rows.append((letter, formulation, mode, str(dtype)[6:], pattern, status))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float64,float32")
    parser.add_argument("--params", action="store_true", help="also non-finite parameters and buffers")
    parser.add_argument("--models", default="", help="letters, e.g. AB")
    args = parser.parse_args()
    autotune.set_enabled(False)
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = [getattr(torch, d) for d in args.dtype.split(",")]
    rows = survey(args.device, dtypes, args.params, set(args.models))
    bad = [r for r in rows if not r[-1].startswith("ok")]
    for r in bad:
        print(" | ".join(r))
    # counts per module x formulation x mode
    table = {}
    for letter, formulation, mode, dtype, pattern, result in rows:
        key = (letter, formulation, mode)
        ok, total = table.get(key, (0, 0))
        table[key] = (ok + result.startswith("ok"), total + 1)
    print(f"\n{'module':6} {'formulation':24} {'mode':5} ok/total")
    for (letter, formulation, mode), (ok, total) in table.items():
        print(f"{letter:6} {formulation:24} {mode:5} {ok}/{total}")
    print(f"\n{len(rows) - len(bad)} of {len(rows)} cases ok", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
