"""The result tables of README.md and docs/*.md, generated from the JSON the benchmarks write
(bench/results/), so that no table drifts from its run. Each table sits between two markers:

    <!-- results: KIND PATH [PATH ...] -->
    (generated)
    <!-- end results -->

KIND is `main_job` (`python -m fused_ops` and bench/models.py results: per model and step, each
peer's time, the fused module's, its speed-up over the best peer, peak memory), `first_calls`
(bench/first_calls.py: seconds per sequence, each variant, the fused module's ratio to eager),
`first_calls_ratios` (the same JSONs: the fused module's ratio to eager alone, a sequence a row) or
`spills` (bench/spills.py: the kernels whose instantiations spill registers beside siblings that do not);
each PATH is relative to the repository's root. Every table is stamped with its JSON's device,
date, torch version and commit (`fused_ops._timing.provenance`).

    python tools/results_tables.py          # rewrites the tables and the README's chart (make bench runs it)
    python tools/results_tables.py --check  # exits 1 where a table differs from its JSON (tests/test_results_tables.py)
"""
import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = re.compile(r"(<!-- results: (\w+) ([^>]*?) -->\n)(.*?)(<!-- end results -->)", re.S)


def documents() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def load(path: str) -> dict:
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def stamp(result: dict, path: str) -> str:
    """`device · torch · date · commit · path` of one JSON."""
    commit = result.get("commit")
    return (f"{result['device']} · torch {result['torch']} · {result.get('date') or 'date not recorded'} · "
            f"{'commit ' + commit if commit else 'commit not recorded'} · `{path}`")


def precision(result: dict) -> str:
    return f"{result['autocast']} autocast" if result.get("autocast") else result.get("dtype", "float32")


def ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def main_job(paths: list[str]) -> str:
    """One row per model, step and precision: the peers' and the fused module's ms, the speed-up
    over the best peer (named), peak MiB of one call (fused / eager)."""
    lines, stamps = [], []
    header = ("| model | step | precision | eager ms | tuned ms | compile ms | fused ms | vs best peer | "
              "peak MiB fused / eager |")
    lines += [header, "| --- | --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for path in paths:
        data = load(path)
        results = [data] if "rows" in data else [data[mode] for mode in ("eval", "train") if mode in data]
        for result in results:
            stamps.append(stamp(result, path))
            step = "training step" if result["train"] else "eval"
            for row in result["rows"]:
                peak = ("-" if row.get("fused_peak_mib") is None
                        else f"{row['fused_peak_mib']:.0f} / {row['eager_peak_mib']:.0f}")
                lines.append(f"| {row['model']} | {step} | {precision(result)} | {ms(row['eager_ms'])} | "
                             f"{ms(row.get('tuned_ms'))} | {ms(row.get('compile_ms'))} | **{ms(row['fused_ms'])}** | "
                             f"{row['vs_best_peer']:.2f}× ({row['best_peer']}) | {peak} |")
    return "\n".join(lines + [""] + [f"<sub>{s}</sub>  " for s in dict.fromkeys(stamps)]) + "\n"


def first_calls(paths: list[str]) -> str:
    """Per JSON, seconds of each sequence for each model and variant, the fused module's ratio to
    the original eager in brackets."""
    out = []
    for path in paths:
        result = load(path)
        names = list(result["rows"][0]["seconds"])
        lines = [f"{precision(result)}:", "",
                 "| model | variant | " + " | ".join(f"{n} s" for n in names) + " |",
                 "| --- | --- | " + " | ".join("---:" for _ in names) + " |"]
        for row in result["rows"]:
            eager = next(r for r in result["rows"] if r["model"] == row["model"] and r["variant"] == "eager")
            cells = [f"{row['seconds'][n]:.4f}" + (f" ({row['seconds'][n] / eager['seconds'][n]:.2f}×)"
                                                   if row["variant"] == "fused" else "") for n in names]
            variant = f"**{row['variant']}**" if row["variant"] == "fused" else row["variant"]
            lines.append(f"| {row['model']} | {variant} | " + " | ".join(cells) + " |")
        out.append("\n".join(lines + ["", f"<sub>{stamp(result, path)}</sub>"]) + "\n")
    return "\n".join(out)


def first_calls_ratios(paths: list[str]) -> str:
    """One row per sequence and JSON (precision), one column per model: the fused module's seconds
    over the original eager's."""
    results = [load(path) for path in paths]
    models = list(dict.fromkeys(row["model"] for row in results[0]["rows"]))
    lines = ["| sequence | precision | " + " | ".join(models) + " |", "| --- | --- | " + " | ".join("---:" for _ in models) + " |"]
    for name in results[0]["rows"][0]["seconds"]:
        for result in results:
            seconds = {(r["model"], r["variant"]): r["seconds"][name] for r in result["rows"]}
            lines.append(f"| {name} | {precision(result)} | "
                         + " | ".join(f"{seconds[m, 'fused'] / seconds[m, 'eager']:.2f}×" for m in models) + " |")
    return "\n".join(lines + [""] + [f"<sub>{stamp(r, p)}</sub>  " for r, p in zip(results, paths)]) + "\n"


def main_job_chart(paths: list[str], out_dir: str = os.path.join(ROOT, "docs", "results")) -> str | None:
    """The main_job table's speed-ups over the best peer as a bar chart (per model a bar per step and
    precision, log scale) at out_dir/<the first JSON's name>.png: its path, or None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    series, stamps = [], []
    for path in paths:
        data = load(path)
        for result in [data] if "rows" in data else [data[mode] for mode in ("eval", "train") if mode in data]:
            step = "training step" if result["train"] else "eval"
            series.append((f"{step}, {precision(result)}", {r["model"]: r["vs_best_peer"] for r in result["rows"]}))
            stamps.append(f"{result['device']}, torch {result['torch']}, {result.get('date')}, "
                          f"commit {result.get('commit')}")
    models = list(series[0][1])
    fig = Figure(figsize=(8, 4.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_yscale("log")
    width = 0.8 / len(series)
    for i, (label, speedups) in enumerate(series):
        positions = [j + (i - (len(series) - 1) / 2) * width for j in range(len(models))]
        values = [speedups[m] for m in models]
        bars = ax.bar(positions, [v - 1 for v in values], width, bottom=1, label=label)
        ax.bar_label(bars, labels=[f"{v:.1f}×" for v in values], fontsize=6)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.margins(y=0.15)
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("speed-up over the best peer (log scale)")
    ax.set_title("fused_ops against the best of eager, tuned and torch.compile\n" + "; ".join(dict.fromkeys(stamps)),
                 fontsize=8)
    ax.legend(fontsize=7)
    out = os.path.join(out_dir, os.path.basename(paths[0]).removesuffix(".json") + ".png")
    fig.savefig(out, dpi=120)
    return out


def spills(paths: list[str]) -> str:
    """bench/spills.py: one row per kernel and variant, what of it spills (ptxas), ms and GB/s."""
    lines = ["| kernel | variant | spills (ptxas) | ms | GB/s |", "| --- | --- | --- | ---: | ---: |"]
    results = [load(path) for path in paths]
    for result in results:
        lines += [f"| {r['kernel']} | {r['variant']} | {'`' + r['spills'] + '`' if r['spills'] else '-'} | "
                  f"{r['ms']:.3f} | {r['gbs']:.0f} |"
                  for r in result["rows"]]
    return "\n".join(lines + [""] + [f"<sub>{stamp(r, p)}</sub>  " for r, p in zip(results, paths)]) + "\n"


KINDS = {"main_job": main_job, "first_calls": first_calls, "first_calls_ratios": first_calls_ratios, "spills": spills}


def render(text: str, where: str) -> str:
    """text with each marked table generated again from its JSON."""
    def table(match: re.Match) -> str:
        kind, paths = match.group(2), match.group(3).split()
        if kind not in KINDS:
            raise SystemExit(f"{where}: unknown results kind {kind!r} (one of {', '.join(KINDS)})")
        return match.group(1) + KINDS[kind](paths) + match.group(5)
    return TABLE.sub(table, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a table is not its JSON's")
    args = parser.parse_args()
    stale, paths = [], documents()
    for path in paths:
        with open(path) as f:
            text = f.read()
        rendered = render(text, os.path.relpath(path, ROOT))
        if rendered != text:
            stale.append(os.path.relpath(path, ROOT))
            if not args.check:
                with open(path, "w") as f:
                    f.write(rendered)
        if path == paths[0] and not args.check:  # (README's main_job chart; unchecked: matplotlib's bytes vary)
            charts = [main_job_chart(m.group(3).split()) for m in TABLE.finditer(text) if m.group(2) == "main_job"]
            drawn = [os.path.relpath(c, ROOT) for c in charts if c]
            print("charts: " + (", ".join(drawn) or "none (matplotlib missing)"))
    if args.check and stale:
        print("result tables that differ from their JSON: " + ", ".join(stale)
              + " (python tools/results_tables.py rewrites them)", file=sys.stderr)
        return 1
    print(("stale: " if args.check else "rewrote: ") + (", ".join(stale) or "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
