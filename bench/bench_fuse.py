"""fused_ops.fuse on models written without fused_ops in mind: each architecture's chain in a
module of its own (other names, functional spellings), traced and fused, against the same model
eager and against the drop-in module around fused_ops.reference's original, eval forward and
training step, in one run (interleaved rounds; CUDA events on a GPU); and the user's model
under torch.compile, without and with the compile patterns (fused_ops.compile_patterns' pass as
that compilation's Inductor option).

    python bench/bench_fuse.py [--device cuda] [--size spec|tiny] [--rounds 5]
"""
import argparse
import contextlib
import copy
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import fused_ops
from fused_ops import architectures, compile_patterns, reference
from timing import device_name, interleaved_medians


class UserA(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Conv3d(8, 16, 3)
        self.shift = nn.Parameter(torch.randn(16, 1, 1, 1))

    def forward(self, x):
        y = F.max_pool3d(torch.div(self.features(x), 2.0), 2).mean((2, 3, 4), keepdim=True)
        return (y + self.shift).sum(dim=1)


class UserB(nn.Module):
    def __init__(self):
        super().__init__()
        self.upsample = nn.ConvTranspose3d(32, 64, 5, stride=2, padding=2)

    def forward(self, x):
        return F.max_pool3d(F.max_pool3d(self.upsample(x), 2), 3).sum(1, keepdim=True)


class UserC(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(8, 64, 3), nn.AvgPool2d(4))

    def forward(self, x):
        return self.body(x).sigmoid().sum(dim=(1, 2, 3))


class UserD(nn.Module):
    def __init__(self):
        super().__init__()
        self.decode = nn.ConvTranspose3d(64, 128, 5)
        self.norm = nn.BatchNorm3d(128)

    def forward(self, x):
        return F.adaptive_avg_pool3d(self.norm(self.decode(x) * 2.0), 1)


USER_MODELS = {"A": UserA, "B": UserB, "C": UserC, "D": UserD}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=("spec", "tiny"), default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    size = args.size or ("spec" if device.type == "cuda" else "tiny")
    print(f"{device_name(device)}, {size} sizes, float32 (TF32 convolutions: {torch.backends.cudnn.allow_tf32})")
    print(f"{'model':<6}{'step':<7}{'user eager ms':>14}{'fused ms':>10}{'drop-in ms':>12}{'speed-up':>10}"
          f"{'fused / drop-in':>17}{'compile ms':>12}{'compile+patterns ms':>21}")
    for architecture in architectures.ARCHITECTURES:
        torch.manual_seed(0)
        user = USER_MODELS[architecture.letter]().to(device)
        fused, report = fused_ops.fuse(user, report=True)
        assert [letter for letter, _ in report.fused] == [architecture.letter], report
        drop_in = architecture.fused_from(getattr(reference, architecture.name)(*architecture.args).to(device))
        x = torch.rand(architecture.input_shape(size), device=device)
        for step in ("eval", "train"):
            for model in (user, fused, drop_in):
                model.train(step == "train")

            def call(model):
                if step == "eval":
                    def run():
                        with torch.no_grad():
                            return model(x)
                else:
                    def run():
                        model(x).float().sum().backward()
                return run

            calls = {"user": call(user), "fused": call(fused), "drop-in": call(drop_in),
                     "compile": call(torch.compile(copy.deepcopy(user).train(step == "train")))}
            # (its own Inductor options: a backend of its own, not the plain compile's cached graph)
            patterned = copy.deepcopy(user).train(step == "train")
            calls["compile+patterns"] = call(torch.compile(
                patterned, options={"pre_grad_custom_pass": compile_patterns._PASS}))
            if not (architecture.letter == "D" and step == "eval"):  # (D's eval map: no fused op)
                with torch.profiler.profile() as profile:
                    calls["compile+patterns"]()
                assert any(e.name.startswith("fused_ops::") for e in profile.events()), architecture.letter
            times = interleaved_medians(calls, device, {name: 10 for name in calls}, args.rounds,
                                        lambda name: contextlib.nullcontext())
            ms = {name: statistics.median(rounds) for name, rounds in times.items()}
            print(f"{architecture.letter:<6}{step:<7}{ms['user']:>14.3f}{ms['fused']:>10.3f}{ms['drop-in']:>12.3f}"
                  f"{ms['user'] / ms['fused']:>9.2f}x{ms['fused'] / ms['drop-in']:>16.2f}x"
                  f"{ms['compile']:>12.3f}{ms['compile+patterns']:>21.3f}")


if __name__ == "__main__":
    main()
