"""The comparison report of the end-to-end runs: reads the JSON files ``gnn_train.py --json`` and
``llm_train.py --json`` write (one or more of each: e.g. 1 and 2 processes), prints the toolkit against the plain
way, and writes CSV files and PNG plots.

    python integration-tests/report.py --gnn gnn-1.json gnn-2.json --llm llm-1.json llm-2.json --out results/

Plots: ``loss_curves.png`` (GNN loss per epoch, LLM loss per step), ``gnn_epoch_time.png`` (toolkit vs baseline per
epoch), ``llm_memory_vs_step_time.png`` (peak device memory against step time, one point per policy and batch).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def load(paths) -> list[dict]:
    out = []
    for path in paths or []:
        path = Path(path)
        if not path.exists():
            print(f"report: {path} is missing (that run failed or did not run): left out", file=sys.stderr)
            continue
        data = json.loads(path.read_text())
        if "impls" in data:  # a GNN run stopped early: keep the implementations with at least one epoch
            data["impls"] = {k: v for k, v in data["impls"].items() if v.get("epochs")}
        out.append(data)
    return out


def mean_epoch(impl: dict) -> float:
    times = [e["time_s"] for e in impl["epochs"]]
    return sum(times) / len(times)


def gnn_lines(runs: list[dict]) -> list[str]:
    lines = []
    for r in runs:
        graph = r["graph"]
        lines.append(f"GNN ({r['size']}, {r['world_size']} process(es) on {r['device']}): {graph['nodes']:,} nodes, "
                     f"{graph['edges']:,} edges, {graph['feature_bytes'] / 2**30:.2f} GiB of features in host memory"
                     + (f", {r['host_feature_copies']:.2f} host copies" if r.get("host_feature_copies") is not None
                        else ""))
        # With batches made on the loader's stream or thread, sample and gather overlap compute: the loader's busy
        # time, and "wait" is how long training waited for a batch.
        lines.append(f"  {'(mean/epoch)':20s} {'ahead':>5s} {'epoch s':>8s} {'seeds/s':>10s} {'sample s':>9s} "
                     f"{'gather s':>9s} {'wait s':>7s} {'compute s':>9s}  {'last epoch: loss':>16s} {'val acc':>7s}")
        for name, impl in r["impls"].items():
            last, n = impl["epochs"][-1], len(impl["epochs"])
            phase = {k: sum(e.get(f"{k}_s", e.get(f"loader_{k}_s", 0.0)) for e in impl["epochs"]) / n
                     for k in ("sample", "gather", "wait", "compute")}
            seeds = sum(e["seeds_per_s"] for e in impl["epochs"]) / n
            lines.append(f"  {name:20s} {impl.get('ahead', 0):5d} {mean_epoch(impl):8.2f} {seeds:10,.0f} "
                         f"{phase['sample']:9.2f} {phase['gather']:9.2f} {phase['wait']:7.2f} {phase['compute']:9.2f}"
                         f"  {last['loss']:16.3f} {last['val_acc']:7.3f}")
        # each way of the toolkit against each way of the baseline: the headline is the toolkit's default against
        # the faster of the baseline's ways
        pairs = [(t, b) for t in r["impls"] if t.startswith("toolkit") for b in r["impls"] if b.startswith("baseline")]
        for toolkit, baseline in pairs:
            t, b = r["impls"][toolkit], r["impls"][baseline]
            lines.append(f"  {toolkit}: {mean_epoch(b) / mean_epoch(t):.2f}x the speed of {baseline} (mean "
                         f"epoch time), val acc {t['epochs'][-1]['val_acc']:.3f} vs "
                         f"{b['epochs'][-1]['val_acc']:.3f} (chance {r['chance_accuracy']:.3f})")
    lines += scaling(runs, "gnn")
    lines += gnn_table(runs)
    return lines


def gnn_table(runs: list[dict]) -> list[str]:
    """One line per single-process run with both implementations: the toolkit's default way against the fastest
    of the baseline's ways, the share of the toolkit's epoch spent waiting for batches, and the accuracies."""
    rows = []
    for r in runs:
        impls = r["impls"]
        baselines = {k: mean_epoch(v) for k, v in impls.items() if k.startswith("baseline")}
        if r["world_size"] != 1 or "toolkit" not in impls or not baselines:
            continue
        best = min(baselines, key=baselines.get)
        t = impls["toolkit"]
        wait = sum(e.get("wait_s", 0.0) for e in t["epochs"]) / sum(e["time_s"] for e in t["epochs"])
        graph = r["graph"]
        rows.append(f"  {graph['nodes']:>11,d} {graph.get('relations', 0):9,d} {mean_epoch(t):10.2f} "
                    f"{best:>16s} {baselines[best]:9.2f} {baselines[best] / mean_epoch(t):7.2f}x {wait:7.1%} "
                    f"{t['epochs'][-1]['val_acc']:8.3f} {impls[best]['epochs'][-1]['val_acc']:8.3f}")
    if not rows:
        return []
    return ["", "GNN: toolkit (default way) against the fastest baseline way, mean epoch time",
            f"  {'nodes':>11s} {'relations':>9s} {'toolkit s':>10s} {'best baseline':>16s} {'its s':>9s} "
            f"{'ratio':>8s} {'wait %':>7s} {'acc tk':>8s} {'acc base':>8s}", *rows]


def llm_lines(runs: list[dict]) -> list[str]:
    lines = []
    for r in runs:
        m = r["config"]["model"]
        lines.append(f"LLM ({r['size']}, {r['world_size']} process(es) on {r['device']}): {m['arch']} "
                     f"{m['layers']} x {m['hidden']}, sequence {m['seq_len']}")
        lines.append(f"  {'policy':9s} {'batch':>5s} {'ms/step':>9s} {'tokens/s':>10s} {'peak GiB':>9s} "
                     f"{'act. GiB':>9s} {'loss':>7s}")
        for run in r["runs"]:
            if run["status"] != "ok":
                lines.append(f"  {run['policy']:9s} {run['batch']:5d} {run['status']}")
                continue
            peak, act = run.get("peak_bytes"), run.get("activation_peak_bytes")
            lines.append(f"  {run['policy']:9s} {run['batch']:5d} {run['step_s'] * 1e3:9.1f} "
                         f"{run['tokens_per_s']:10,.0f} {_gib(peak):>9s} {_gib(act):>9s} {run['losses'][-1]:7.3f}")
        keep = [x for x in r["runs"] if x["policy"] == "keep" and x["status"] == "ok"]
        oom = [x["batch"] for x in r["runs"] if x["policy"] == "keep" and x["status"] != "ok"]
        best = max(keep, key=lambda x: x["batch"]) if keep else None
        for x in r["runs"]:
            if x["policy"] != "keep" and x["status"] == "ok" and best is not None:
                fits = f"; keep ran out of memory at batch {min(oom)}" if oom and min(oom) <= x["batch"] else ""
                lines.append(f"  {x['policy']} at batch {x['batch']} = {x['batch'] / best['batch']:.2f}x keep's "
                             f"largest ({best['batch']}): {x['tokens_per_s'] / best['tokens_per_s']:.2f}x keep's "
                             f"tokens/s{fits}")
    lines += scaling(runs, "llm")
    return lines


def _gib(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**30:.2f}"


def throughput(r: dict, kind: str) -> tuple[str, float] | None:
    """The toolkit's throughput in a run: GNN seeds/s (mean over epochs), LLM ssdtrain tokens/s (None if absent)."""
    if kind == "gnn":
        impl = r["impls"].get("toolkit")
        if not impl:
            return None
        return "seeds/s", sum(e["seeds_per_s"] for e in impl["epochs"]) / len(impl["epochs"])
    ok = [x for x in r["runs"] if x["policy"] == "ssdtrain" and x["status"] == "ok"]
    return (f"tokens/s at batch {ok[-1]['batch']}", ok[-1]["tokens_per_s"]) if ok else None


def scaling(runs: list[dict], kind: str) -> list[str]:
    """Throughput with N processes against one, between runs of the same configuration."""
    groups: dict[str, dict[int, tuple[str, float] | None]] = {}
    for r in runs:
        config = r.get("config", {})
        key = json.dumps(config.get("graph") or config.get("model"), sort_keys=True)
        groups.setdefault(key, {}).setdefault(r["world_size"], throughput(r, kind))
    lines = []
    for by_world in groups.values():
        one = by_world.get(1)
        for world, value in sorted(by_world.items()):
            if world > 1 and value and one:
                lines.append(f"  scaling: {world} processes {value[1]:,.0f} {value[0]} = {value[1] / one[1]:.2f}x "
                             f"one process ({one[1]:,.0f})")
    return lines


def write_csv(out: Path, gnn: list[dict], llm: list[dict]) -> list[Path]:
    written = []
    if gnn:
        path = out / "gnn.csv"
        fields = ["size", "world_size", "impl", "epoch", "time_s", "seeds_per_s", "edges_per_s", "loss", "val_acc",
                  "sample_s", "gather_s", "compute_s", "wait_s", "loader_sample_s", "loader_gather_s", "ahead",
                  "loader", "peak_gpu_bytes"]
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fields, extrasaction="ignore")
            w.writeheader()
            for r in gnn:
                for name, impl in r["impls"].items():
                    for e in impl["epochs"]:
                        w.writerow({"size": r["size"], "world_size": r["world_size"], "impl": name,
                                    "ahead": impl.get("ahead", 0), "loader": impl.get("loader", ""),
                                    "peak_gpu_bytes": impl.get("peak_gpu_bytes"), **e})
        written.append(path)
    if llm:
        path = out / "llm.csv"
        fields = ["size", "world_size", "policy", "batch", "seq_len", "status", "step_s", "tokens_per_s", "tflops",
                  "peak_bytes", "activation_peak_bytes", "first_loss", "last_loss"]
        with path.open("w", newline="") as f:
            w = csv.DictWriter(f, fields, extrasaction="ignore")
            w.writeheader()
            for r in llm:
                for run in r["runs"]:
                    losses = run.get("losses") or [None]
                    w.writerow({"size": r["size"], **run, "world_size": r["world_size"], "first_loss": losses[0],
                                "last_loss": losses[-1]})
        written.append(path)
    return written


def plot(out: Path, gnn: list[dict], llm: list[dict]) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"toolkit": "tab:blue", "baseline": "tab:orange", "keep": "tab:orange", "recompute": "tab:green",
              "ssdtrain": "tab:blue"}
    # dashed plain ways drawn over solid toolkit lines: where the losses agree, both stay visible
    styles = {"toolkit": "-", "baseline": "--", "keep": "--", "recompute": ":", "ssdtrain": "-"}
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in gnn:
        for name, impl in r["impls"].items():
            losses = [v for e in impl["epochs"] for v in e["batch_losses"]]
            base = name.split("-")[0]  # the other loading ways (-inturn / -ahead / -thread): same colour, dotted
            axes[0].plot(range(1, len(losses) + 1), losses, color=colors.get(base),
                         linestyle=":" if base != name else styles.get(name),
                         alpha=1.0 if r["world_size"] == 1 else 0.5, label=f"{name} ({r['world_size']} proc.)")
    axes[0].set(title="GNN: training loss per mini-batch", xlabel="step (per process)", ylabel="cross-entropy")
    for r in llm:
        for run in r["runs"]:
            if run["status"] == "ok":
                axes[1].plot(range(1, len(run["losses"]) + 1), run["losses"], color=colors.get(run["policy"]),
                             alpha=(0.4 + 0.6 * run["batch"] / max(x["batch"] for x in r["runs"])) *
                             (1.0 if r["world_size"] == 1 else 0.6), linestyle=styles.get(run["policy"]),
                             label=f"{run['policy']} b{run['batch']} ({r['world_size']} proc.)")
    axes[1].set(title="LLM: training loss", xlabel="step", ylabel="cross-entropy")
    for ax in axes:
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(_save(fig, out / "loss_curves.png"))

    if gnn:
        fig, ax = plt.subplots(figsize=(6, 4))
        labels, values, bar_colors = [], [], []
        for r in gnn:
            for name, impl in r["impls"].items():
                for e in impl["epochs"]:
                    short = name.replace("toolkit", "tk").replace("baseline", "pyg")
                    short = short.replace("-inturn", "-in").replace("-ahead", "-ah").replace("-thread", "-th")
                    labels.append(f"{short} {r['world_size']}p e{e['epoch']}")
                    values.append(e["time_s"])
                    bar_colors.append(colors.get(name.split("-")[0]))
        ax.bar(range(len(values)), values, color=bar_colors)
        ax.set_xticks(range(len(values)), labels, rotation=60, fontsize=7, ha="right")
        ax.set(title="GNN epoch time: toolkit (blue) vs plain PyTorch/PyG (orange)", ylabel="seconds")
        fig.tight_layout()
        written.append(_save(fig, out / "gnn_epoch_time.png"))

    if llm:
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in llm:
            for run in r["runs"]:
                if run["status"] != "ok" or run.get("peak_bytes") is None:
                    continue
                ax.scatter(run["peak_bytes"] / 2**30, run["step_s"] * 1e3, color=colors.get(run["policy"]),
                           marker="o" if r["world_size"] == 1 else "s")
                ax.annotate(f"{run['policy']} b{run['batch']}", (run["peak_bytes"] / 2**30, run["step_s"] * 1e3),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
            ooms = [run["batch"] for run in r["runs"] if run["status"] != "ok"]
            if ooms:
                ax.axvline(torch_total_memory_gib(r), color="red", linestyle=":", label="device memory")
        ax.set(title="LLM: peak device memory vs step time", xlabel="peak memory (GiB)", ylabel="ms per step")
        if not ax.collections:
            ax.text(0.5, 0.5, "no device-memory figures (CPU run)", ha="center", transform=ax.transAxes)
        fig.tight_layout()
        written.append(_save(fig, out / "llm_memory_vs_step_time.png"))
    return written


def torch_total_memory_gib(r: dict) -> float:
    return r.get("environment", {}).get("gpu_memory_bytes", 0) / 2**30


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(gnn_paths, llm_paths, out: str | Path | None) -> str:
    gnn, llm = load(gnn_paths), load(llm_paths)
    text = "\n".join(gnn_lines(gnn) + ([""] if gnn and llm else []) + llm_lines(llm))
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        files = write_csv(out, gnn, llm) + plot(out, gnn, llm)
        (out / "report.txt").write_text(text + "\n")
        text += "\n\nwritten: " + ", ".join(str(p) for p in files + [out / "report.txt"])
    return text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gnn", nargs="*", default=[], help="gnn_train.py JSON results")
    parser.add_argument("--llm", nargs="*", default=[], help="llm_train.py JSON results")
    parser.add_argument("--out", default=None, help="folder for CSV, PNG and report.txt")
    args = parser.parse_args(argv)
    print(report(args.gnn, args.llm, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
