"""The autotuner chooses from the user's own calls (issue 43): the first call of a key runs the rule's
formulation, no call is made that the user did not make, batch sizes share a bucket's choice, choices
are saved and loaded across processes and made ahead of time (warmup), and one module may be called
from several threads at once."""
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from conftest import requires_cuda
from fused_ops import autotune
from test_formulations import CONFIGS, IDS, pair
from test_graphed_calls import settle_graphed


@pytest.fixture
def tuner():
    autotune.clear()
    autotune.set_enabled(True)
    yield
    autotune.clear()


def counting_runs(monkeypatch, fused):
    """The formulations fused's calls run (those that hold), in order."""
    ran, run = [], fused._run

    def counted(name, x):
        out = run(name, x)
        if out is not None:
            ran.append(name)
        return out
    monkeypatch.setattr(fused, "_run", counted)
    return ran


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_no_call_the_user_did_not_make(name, args, shape, train, tuner, monkeypatch):
    """Each call runs one formulation once, the first the rule's; trying the others from the start
    (exploring), the key settles within MAX_TUNING_CALLS calls, every output the original's."""
    original, fused = pair(name, args, "cpu", train=train)
    autotune.set_enabled(False)
    with torch.no_grad():
        pair(name, args, "cpu", train=train)[1](torch.rand(shape, dtype=torch.float64))
    rule = autotune.last_formulation()
    autotune.set_enabled(True)
    ran = counting_runs(monkeypatch, fused)
    calls = autotune.MAX_TUNING_CALLS + 2
    with autotune.exploring():
        for i in range(calls):
            x = torch.rand(shape, dtype=torch.float64, requires_grad=train)
            out = fused(x)
            torch.testing.assert_close(out, original(x), rtol=1e-9, atol=1e-12)
            if train:
                out.sum().backward()
    assert len(ran) == calls and ran[0] == rule
    assert fused.formulation(x) == ran[-1]


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_trying_the_others_waits_until_it_pays(train, tuner, monkeypatch):
    """A key's calls run the rule's formulation until the time they took is 1/EXPLORE_SHARE times the
    expected cost of trying the others (_Tuning._pays): 20 calls of a small input run the rule alone;
    with a share of 1/2 the others are tried, from the call at which it first pays."""
    name, args, shape = CONFIGS[0]
    original, fused = pair(name, args, "cpu", train=train)
    ran = counting_runs(monkeypatch, fused)
    paid, pays = [], autotune._Tuning._pays
    monkeypatch.setattr(autotune._Tuning, "_pays", lambda self: paid.append(pays(self)) or paid[-1])

    def call():
        x = torch.rand(shape, dtype=torch.float64, requires_grad=train)
        with torch.set_grad_enabled(train):
            out = fused(x)
            torch.testing.assert_close(out, original(x), rtol=1e-9, atol=1e-12)
        if train:
            out.sum().backward()
    for _ in range(20):
        call()
    assert len(ran) == 20 and set(ran) == {ran[0]} and paid and not any(paid)
    monkeypatch.setattr(autotune, "EXPLORE_SHARE", 0.5)
    for _ in range(4000):  # (a first call slowed by a loaded host makes trying pay later: _pays's set-up)
        call()
        if ran[-1] != ran[0]:
            break
    assert ran[-1] != ran[0] and paid[-1] and not any(paid[:-1])



@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_a_short_run_is_not_timed(train, tuner, monkeypatch):
    """Before its calls could tell that trying the others pays (_Tuning._samples_from), the rule's
    calls are not timed (no CUDA events, no backward hooks: a timed call cost the host ~0.4 ms on a
    GPU), its first call of a shape by the host's clock alone; from then on, SAMPLES of them are."""
    name, args, shape = CONFIGS[0]
    _, fused = pair(name, args, "cpu", train=train)
    timings, real = [], autotune._Timing.__init__
    monkeypatch.setattr(autotune._Timing, "__init__", lambda self, x: timings.append(self) or real(self, x))

    def call(batch=4):
        with torch.set_grad_enabled(train):
            out = fused(torch.rand(batch, *shape[1:], dtype=torch.float64, requires_grad=train))
        if train:
            out.sum().backward()
    call()
    (tuning,) = autotune._TUNINGS.values()
    lead = tuning.candidates[0]
    call(batch=3)  # (another shape of the key's batch-size bucket)
    while tuning.calls < tuning._samples_from() - 1:
        call()
    assert tuning._samples_from() >= 40 and timings == [] and len(tuning.firsts[lead]) == 2
    for _ in range(autotune.SAMPLES + 2):
        call()
    assert len(timings) == autotune.SAMPLES and tuning.choice is None and tuning.explored is None


def test_calls_like_the_one_before_skip_the_key_while_it_chooses(tuner, monkeypatch):
    """While a key still chooses (trying the others does not pay yet), a call with the signature of the
    module's call before runs by its key's tuning without building the key or listing the formulations
    (host time: ~20 us a call on the 2-core CPU), and still counts as the key's call."""
    name, args, shape = CONFIGS[0]
    original, fused = pair(name, args, "cpu", train=False)
    built = []
    for attr in ("_config", "_formulations"):
        method = getattr(fused, attr)
        monkeypatch.setattr(fused, attr, lambda *a, _method=method, _attr=attr: built.append(_attr) or _method(*a))
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(12):
            torch.testing.assert_close(fused(x), original(x), rtol=1e-9, atol=1e-12)
    (tuning,) = autotune._TUNINGS.values()
    assert built == ["_formulations", "_config"] and tuning.choice is None and tuning.calls == 12

def test_batch_sizes_share_a_bucket(tuner):
    name, args, shape = CONFIGS[0]
    _, fused = pair(name, args, "cpu", train=False)
    with torch.no_grad():
        for batch in (3, 4, 5, 8, 1):
            fused(torch.rand(batch, *shape[1:], dtype=torch.float64))
    assert sorted(key[2][0][0] for key in autotune._TUNINGS) == [1, 4, 8]


def test_saved_choices_load_in_a_new_process(tuner, tmp_path, monkeypatch):
    """save writes the settled choices (per torch and fused_ops version); after load (a new process:
    clear) the first call of a saved key runs its choice, untimed."""
    name, args, shape = CONFIGS[2]
    _, fused = pair(name, args, "cpu", train=False)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        chosen = autotune.warmup(fused, x)
        assert list(chosen.values()) == [fused.formulation(x)]
    path = str(tmp_path / "choices.json")
    autotune.save(path)
    autotune.clear()
    assert autotune.load(path) == 1
    _, fresh = pair(name, args, "cpu", train=False)
    ran = counting_runs(monkeypatch, fresh)
    with torch.no_grad():
        fresh(x)
        assert fresh.formulation(x) == ran[0]
    assert ran == list(chosen.values())


def test_choices_saved_under_other_rules_are_not_read(tuner, tmp_path, monkeypatch):
    """A file's choices made under other tuner rules (CHOICE_RULES: a graph kept before the graph-copy rule
    say) or another version are not read; this version's beside them are."""
    name, args, shape = CONFIGS[2]
    _, fused = pair(name, args, "cpu", train=False)
    x = torch.rand(shape, dtype=torch.float64)
    with torch.no_grad():
        autotune.warmup(fused, x)
    path = str(tmp_path / "choices.json")
    with monkeypatch.context() as rules:
        rules.setattr(autotune, "CHOICE_RULES", autotune.CHOICE_RULES - 1)
        autotune.save(path)
    autotune.clear()
    assert autotune.load(path) == 0
    with torch.no_grad():
        autotune.warmup(fused, x)
    autotune.save(path)
    autotune.clear()
    assert autotune.load(path) == 1
    with open(path) as f:
        assert len(json.load(f)) == 2  # (both rules' choices kept in the file)


FIRST_CALLS = """
import sys, torch
import fused_ops
from fused_ops.architectures import ARCHITECTURES
before = set(sys.modules)
for arch in ARCHITECTURES:
    module = arch.fused_from(arch.build_original())
    x = torch.rand(arch.input_shape("tiny"))
    with torch.no_grad():
        module.eval()(x)
    out = module.train()(x)
    torch.autograd.grad(out.sum(), list(module.parameters()))
print(" ".join(sorted(set(sys.modules) - before)))
"""


def test_first_calls_import_nothing_heavy():
    """A new process's first eval call and training step of each drop-in (the tuner on, its default)
    import none of sympy, Dynamo, Inductor or torch.fx's symbolic shapes: seconds on a user's first
    call (torch._prims_common's stride helpers once imported sympy there: 1.1 s on the 2-core CPU)."""
    done = subprocess.run([sys.executable, "-c", FIRST_CALLS], capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "FUSED_OPS_AUTOTUNE"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported = done.stdout.split()
    heavy = [m for m in imported if m.split(".")[0] == "sympy"
             or m.startswith(("torch._dynamo", "torch._inductor", "torch.fx.experimental"))]
    assert not heavy, heavy


def test_warmup_restores_the_running_statistics(tuner):
    name, args, shape = CONFIGS[3]
    original, fused = pair(name, args, "cpu", train=True)
    before = [b.clone() for b in fused.buffers()]
    chosen = autotune.warmup(fused, torch.rand(shape, dtype=torch.float64, requires_grad=True))
    assert chosen and all(v in fused.FORMULATIONS for v in chosen.values())
    for b, e in zip(fused.buffers(), before, strict=True):
        assert torch.equal(b, e)


@pytest.mark.parametrize("graphs", [False, True], ids=["tuning", "graphed"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_one_module_from_several_threads(name, args, shape, graphs, device, tuner, monkeypatch):
    """Four threads call one eval module at once, each its own inputs (batch sizes 1-4): while the
    keys tune, or (on a GPU) with every key settled on a CUDA graph from its first call, captured
    while other threads' calls are in flight: every result the original's for its input, no error."""
    if graphs and device != "cuda":
        pytest.skip("CUDA graphs: on a GPU")
    if graphs:
        settle_graphed(monkeypatch)
    original, fused = pair(name, args, device, train=False)
    errors, mismatches = [], []

    def serve(seed):
        g = torch.Generator().manual_seed(seed)
        try:
            for i in range(6):
                x = torch.rand(1 + (seed + i) % 4, *shape[1:], dtype=torch.float64, generator=g).to(device)
                with torch.no_grad():
                    out, expected = fused(x), original(x)
                if not torch.allclose(out, expected, rtol=1e-9, atol=1e-12):
                    mismatches.append((seed, i))
        except Exception as error:  # (reported below)
            errors.append(error)
    threads = [threading.Thread(target=serve, args=(seed,)) for seed in range(4)]
    with autotune.exploring():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == [] and mismatches == []


@requires_cuda
@pytest.mark.parametrize("threads", ["one-thread", "other-threads"])
@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_tried_and_settled_calls_search_their_plans(name, args, shape, threads, tuner, monkeypatch, request):
    """On a GPU the candidates being tried, and the settled choice, run their rearranged and channels-last
    convolutions with cudnn.benchmark on (PyTorch keeps a convolution's first plan, searched or guessed,
    for good: tried unsearched, a candidate's guess would be what it was timed and kept with), the
    formulations with the original's own convolution under the user's setting (off here, and left so).
    The setting is the process's: with another Python thread running, no formulation switches it (that
    thread's convolutions would search meanwhile, and a search running into a capture fails it)."""
    if threads == "one-thread":
        # (a thread an earlier test left, e.g. Inductor's compile pool's, would count as another)
        monkeypatch.setattr(autotune, "_alone", lambda: True)
    else:
        stop = threading.Event()
        other = threading.Thread(target=stop.wait, daemon=True)
        other.start()
        request.addfinalizer(stop.set)
    assert not torch.backends.cudnn.benchmark
    _, fused = pair(name, args, "cuda", dtype=torch.float32, train=False)
    seen, run = [], fused._run

    def recorded(formulation, x):
        seen.append((formulation, torch.backends.cudnn.benchmark))
        return run(formulation, x)
    monkeypatch.setattr(fused, "_run", recorded)
    with torch.no_grad(), autotune.exploring():
        for _ in range(autotune.MAX_TUNING_CALLS + 2):
            fused(torch.rand(shape, device="cuda"))
        assert fused.formulation(torch.rand(shape, device="cuda")) is not None  # (settled)
    assert {formulation for formulation, _ in seen} > {"fused", "original"}
    alone = threads == "one-thread"
    assert all(searched == (alone and formulation not in autotune.OWN_CONVOLUTION) for formulation, searched in seen)
    assert not torch.backends.cudnn.benchmark


@pytest.mark.parametrize("name,args,shape", CONFIGS, ids=IDS)
def test_tuned_timings_name_the_candidates_timed(name, args, shape, tuner):
    """A module's tuned_timings(x): each candidate its settled key timed, its median device and host ms; the
    choice the fastest forward, or the original's ops within PREFERRED_MARGIN of it; empty before any call."""
    _, fused = pair(name, args, "cpu", train=False)
    x = torch.rand(shape, dtype=torch.float64)
    assert fused.tuned_timings(x) == {}
    with torch.no_grad(), autotune.exploring():
        for _ in range(autotune.MAX_TUNING_CALLS + 2):
            fused(x)
        timings, choice = fused.tuned_timings(x), fused.formulation(x)  # (under the calls' grad mode: their key)
    assert choice in timings and all(device > 0 and host > 0 for device, host in timings.values())
    fastest = min(device for device, _ in timings.values())
    assert timings[choice][0] == fastest or (choice == "original"
                                             and timings[choice][0] <= fastest * (1 + autotune.PREFERRED_MARGIN))


def test_memory_reports_the_graphs(tuner):
    held = autotune.memory()
    assert held == {"graphs": 0, "bytes": 0}


def test_a_new_bucket_starts_from_its_neighbours_choice(tuner, monkeypatch):
    """A batch-size bucket met after another settled starts with that one's choice; it leaves out the
    formulations that one dropped (far slower, not holding, raising) only where the two batches lie within
    a factor of two (the fastest changes with the batch)."""
    name, args, shape = CONFIGS[1]
    _, fused = pair(name, args, "cpu", train=False)
    with torch.no_grad():
        settled = autotune.warmup(fused, torch.rand(4, *shape[1:], dtype=torch.float64))
        (neighbour,) = [t for t in autotune._TUNINGS.values() if t.choice is not None]
        order = fused._order(torch.rand(4, *shape[1:], dtype=torch.float64))
        slow = next(n for n in order if n != neighbour.choice[0])
        neighbour.dropped.add(slow)  # (as if its timings had found it far slower)
        ran = counting_runs(monkeypatch, fused)
        for batch in (2, 32):  # (buckets 2 and 32: next to 4's, and 8 times it)
            fused(torch.rand(batch, *shape[1:], dtype=torch.float64))
    new = {t.key[2][0][0]: t for t in autotune._TUNINGS.values() if t.choice is None}
    assert ran == list(settled.values()) * 2
    assert [new[2].candidates[0], new[32].candidates[0]] == [neighbour.choice[0]] * 2
    assert slow not in new[2].candidates and slow in new[32].candidates
