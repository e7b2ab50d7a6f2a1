"""Smoke test of the LLM benchmark at a tiny size on CPU (speed and memory are reported by it, never asserted).

The benchmark forks a process per policy, so it runs here as a fresh process: a pytest process that has used
torch's thread pools (or ssdtrain's I/O threads) is no safe parent for fork."""

import argparse
import csv
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "llm.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("ssdtrain_llm_benchmark", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llm_benchmark_jobs():
    llm = _bench_module()
    a = argparse.Namespace(models=["gpt2", "llama"], oom_batch=24, no_determinism=False, device="cuda")
    jobs = llm.plan_jobs(a)
    assert len(set(jobs)) == len(jobs)
    for model, policy, spec in [
        ("gpt2", "recompute+compile", None),
        ("gpt2", "ssdtrain+compile", "recompute*1.2"),
        ("gpt2", "ssdtrain+compile", "save_on_cpu*1.0"),
        ("llama", "compile", None),
        ("llama", "recompute+compile", None),
        ("llama", "ssdtrain+compile", "keep*0.5"),
        ("llama", "ssdtrain+compile", "recompute*1.2"),
    ]:
        i = jobs.index((model, policy, spec))
        assert i < jobs.index(("gpt2", "determinism", None))  # before the extras a deadline cuts first
    for i, (model, policy, spec) in enumerate(jobs):
        if spec not in (None, "oom", "none"):  # a budget needs its reference measured earlier for the same model
            assert (model, spec.split("*")[0], None) in jobs[:i], (model, policy, spec)
    assert jobs.index(("gpt2", "ssdtrain", "save_on_cpu*1.0")) < jobs.index(("gpt2", "recompute+compile", None))
    assert jobs.index(("llama", "ssdtrain", "recompute*1.2")) < jobs.index(("llama", "compile", None))


def test_llm_benchmark_targets():
    llm = _bench_module()

    def row(policy, ms, gib):
        return {"model": "gpt2", "policy": policy, "status": "ok", "step_ms": ms, "peak_gib": gib, "batch": 8}

    results = [
        row("keep", 100.0, 10.0),
        row("recompute", 130.0, 2.0),
        row("recompute+compile", 110.0, 2.1),
        row("ssdtrain@keep*0.5", 108.0, 4.8),
        row("ssdtrain+compile@keep*0.5", 104.0, 4.9),
        row("ssdtrain@recompute*1.2", 125.0, 2.3),
        row("ssdtrain+compile@recompute*1.2", 115.5, 2.3),
    ]
    lines = llm.targets(results, argparse.Namespace(models=["gpt2"], batch=8, oom_batch=0))
    text = "\n".join(lines)
    assert "(1) gpt2" in text and "ssdtrain+compile@keep*0.5 104.0 ms" in text
    (two,) = [line for line in lines if line.startswith("(2) gpt2")]
    assert "ssdtrain+compile@recompute*1.2 115.5 ms" in two and two.endswith("-> MET")
    (vs,) = [line for line in lines if "vs recompute+compile" in line]
    assert "1.05x its time" in vs and "eager" in vs
    assert results[2]["x_keep_time"] == 1.1  # compared with eager keep


def test_llm_benchmark_quick(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "llm.csv", tmp_path / "rok.png"
    policies = (
        "keep,recompute,recompute+compile,save_on_cpu,compile_budget_0.5,torchtune,ssdtrain@none,ssdtrain@keep*0.5,"
        "ssdtrain+compile@recompute*1.2,determinism"
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--quick",
            "--device",
            "cpu",
            "--models",
            "gpt2",
            "--policies",
            policies,
            "--csv",
            str(out),
            "--png",
            str(png),
            "--child-timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    for name in ("keep", "recompute", "recompute+compile", "save_on_cpu", "compile_budget_0.5", "ssdtrain@none"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["step_ms"]) > 0
    assert rows["ssdtrain@keep*0.5"]["status"] in ("ok", "budget")  # tiny models may not fit half
    assert rows["ssdtrain+compile@recompute*1.2"]["status"] in ("ok", "budget")
    assert rows["torchtune"]["status"] in ("ok", "unavailable")
    assert rows["determinism"]["status"] == "ok"
    assert "(5)" in text and "-> MET" in text  # bit-identical losses, gradients and weights
    assert png.stat().st_size > 1000


def test_llm_budget_suite_quick(tmp_path):
    """The budget suite at a tiny size on CPU: every part runs (budget rows, recompute's largest batch against
    budget=None, the NVMe run with host RAM capped, bit-identical gradients), and writes its table, CSV and PNG."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "budget.csv", tmp_path / "budget.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--suite", "budget", "--quick", "--device", "cpu", "--cells", "1"]
        + ["--nvme-dir", str(tmp_path), "--csv", str(out), "--png", str(png), "--child-timeout", "300"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    parts = {r["part"] for r in rows}
    assert parts == {"budget", "maxbatch", "nvme"}, parts
    assert {r["status"] for r in rows if r["part"] != "budget" or r["policy"] == "keep"} == {"ok"}
    assert "(2) batch" in text and "(3) control: keep run twice, gradients bit-identical: True" in text
    assert "ssdtrain@cap: NVMe" in text and "ssdtrain@cap+nvme: NVMe" in text
    assert text.count("bit-identical to keep: True") == 2  # a step under the final plan, both ssdtrain runs
    assert "at best overlapped" in text
    assert "NVMe carries load, bit-identical: MET" in text
    assert png.stat().st_size > 1000


ROK_QUICK = (
    "keep,recompute,sac,ssdtrain@keep*0.7,ssdtrain@sac*1.0,ssdtrain-derive,save_on_cpu,torchtune,trl,compile,"
    "compile_budget_0.5,ssdtrain+compile@compile_budget_0.5*1.0,ssdtrain+compile_budget_0.8@compile_budget_0.5*1.0"
)


def test_llm_rok_suite_quick(tmp_path):
    """The ROK suite at a tiny size on CPU with accumulation and autocast: every kind of peer runs (or says why it
    cannot: torchtune's and TRL's offloading need CUDA), ssdtrain eager and compiled at budgets, table, CSV, PNG."""
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    out, png = tmp_path / "rok.csv", tmp_path / "rok.png"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--suite", "rok", "--quick", "--device", "cpu", "--policies", ROK_QUICK]
        + ["--csv", str(out), "--png", str(png), "--child-timeout", "300"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=tmp_path,
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == set(ROK_QUICK.split(","))
    for name in ("keep", "recompute", "sac", "save_on_cpu", "compile", "compile_budget_0.5"):
        assert rows[name]["status"] == "ok", rows[name]
    assert rows["ssdtrain@keep*0.7"]["status"] == "ok" and rows["ssdtrain@sac*1.0"]["status"] == "ok"
    assert rows["ssdtrain-derive"]["status"] == "ok" and "derive" in rows["ssdtrain-derive"]["plan"]
    plain = rows["ssdtrain+compile@compile_budget_0.5*1.0"]
    composed = rows["ssdtrain+compile_budget_0.8@compile_budget_0.5*1.0"]
    assert plain["status"] == composed["status"] == "ok", (plain, composed)
    # The composed row's blocks were compiled under the compiler's budget 0.8: each saves less than without one.
    assert 0 < float(composed["block_saved_mib"]) < 0.9 * float(plain["block_saved_mib"])
    assert composed["group"] == "compiled"
    assert rows["torchtune"]["status"] == rows["trl"]["status"] == "unavailable"
    assert rows["sac"]["group"] == "eager" and rows["compile_budget_0.5"]["group"] == "compiled"
    assert all(r["accum"] == "2" for r in rows.values())
    assert "no activation peak measured on cpu" in text
    assert png.stat().st_size > 1000


def test_llm_rok_targets(tmp_path):
    """The ROK verdicts from made-up rows: half of keep's peak within 1.10x its time, 1.2x recompute's peak
    within 0.90x its time, and each peer beaten by an ssdtrain point of its own kind at <= its peak."""
    sys.path.insert(0, str(BENCH.parent))
    import llm_rok

    def row(policy, ms, gib):
        return {"model": "llama", "group": llm_rok.group_of(policy), "policy": policy, "status": "ok",
                "step_ms": ms, "peak_gib": gib}  # fmt: skip

    results = [
        row("keep", 1000, 40),
        row("recompute", 1300, 10),
        row("sac", 1080, 20),
        row("compile", 800, 30),
        row("compile_budget_0.5", 900, 18),
        row("compile_budget_0.2", 950, 14),
        row("ssdtrain@keep*0.5", 1070, 19.5),
        row("ssdtrain@recompute*1.2", 1200, 11.9),
        row("ssdtrain+compile@compile_budget_0.5*1.0", 950, 17),
        row("ssdtrain+compile_budget_0.8@compile_budget_0.5*1.0", 880, 17.5),
        row("ssdtrain+compile_budget_0.5@compile_budget_0.2*1.0", 960, 13.9),
    ]
    text = "\n".join(llm_rok.targets(results, argparse.Namespace(models=["llama"], device="cuda")))
    assert "(1) llama eager" in text and "ssdtrain@keep*0.5 1070.0 ms" in text
    lines = {line.split(":")[0]: line for line in text.splitlines()}
    assert lines["(1) llama eager"].endswith("MET")
    assert lines["(2) llama eager"].endswith("MISSED")  # 1200 > 0.90 x 1300
    assert [x for x in text.splitlines() if "than sac" in x][0].endswith("MET")  # 1070 at 19.5 GiB vs 1080 at 20
    assert [x for x in text.splitlines() if "than recompute" in x][0].endswith("at that memory -> MISSED")
    # Compiled against compiled: the fastest ssdtrain+compile* row at <= the peer's peak, either way of compiling.
    (b5,) = [x for x in text.splitlines() if "than compile_budget_0.5" in x]
    assert "ssdtrain+compile_budget_0.8@compile_budget_0.5*1.0 880.0 ms" in b5 and b5.endswith("MET")
    (b2,) = [x for x in text.splitlines() if "than compile_budget_0.2" in x]
    assert "ssdtrain+compile_budget_0.5@compile_budget_0.2*1.0 960.0 ms" in b2 and b2.endswith("MISSED")
    ways = [x for x in text.splitlines() if "ssdtrain around blocks compiled with a budget" in x]
    assert ways[0].endswith(
        "with a budget: ssdtrain+compile_budget_0.8@compile_budget_0.5*1.0 880.0 ms, 17.50 GiB; "
        "without one: ssdtrain+compile@compile_budget_0.5*1.0 950.0 ms, 17.00 GiB"
    )
    assert ways[1].endswith("without one: no run at that memory")
    assert not [x for x in text.splitlines() if "eager" in x and "around blocks" in x]
    if importlib.util.find_spec("matplotlib") is not None:  # the plot of measured peaks (GPU runs): both curves
        a = argparse.Namespace(models=["llama"], device="cuda", groups="eager,compiled", layers=16, hidden=2048,
                               batch=4, seq=2048, accum=4)  # fmt: skip
        llm_rok.plot(tmp_path / "rok.png", results, a)
        assert (tmp_path / "rok.png").stat().st_size > 1000


def test_llm_rok_compiled_jobs_follow_their_baselines():
    """Every compiled ssdtrain job comes after the peer whose peak sets its budget, and the compiler's budget of a
    policy is read from its name."""
    sys.path.insert(0, str(BENCH.parent))
    import llm_rok

    jobs = llm_rok.plan_jobs(["llama"], ("compiled",))
    policies = [p if s is None else f"{p}@{s}" for _, p, s in jobs]
    for i, (_, policy, spec) in enumerate(jobs):
        assert llm_rok.group_of(policy) == "compiled"
        if spec is not None:
            assert spec.split("*")[0] in policies[:i], policy
    composed = [p for p, _ in llm_rok.COMPILED if p.startswith("ssdtrain+compile_budget")]
    assert len(composed) >= 3
    assert llm_rok.compile_memory_budget("ssdtrain+compile_budget_0.8") == 0.8
    assert llm_rok.compile_memory_budget("compile_budget_0.2") == 0.2
    assert llm_rok.compile_memory_budget("ssdtrain+compile") is None
    with pytest.raises(ValueError, match="compile_budget_X"):
        llm_rok.compile_memory_budget("ssdtrain+compile_budget_x")


def test_llm_rok_override_plans_place_moved_and_recomputed_blocks():
    """``ssdtrain-derive+hostN`` spreads N moved blocks, ``...first`` takes the first N, ``+recomputeR`` recomputes
    the last R blocks not moved; only the named policies are planned, after the suite's."""
    sys.path.insert(0, str(BENCH.parent))
    import llm_rok

    blocks = [f"b{i}" for i in range(16)]
    short = {"derive": "d", "derive+host": "H", "recompute": "R"}

    def shape(policy):
        overrides = llm_rok.derive_overrides(policy, blocks)
        return "".join(short[overrides[b]] for b in blocks)

    assert shape("ssdtrain-derive") == "d" * 16
    assert shape("ssdtrain-derive+host4") == "Hddd" * 4
    assert shape("ssdtrain-derive+host5first") == "H" * 5 + "d" * 11
    assert shape("ssdtrain-derive+host3first+recompute2") == "HHH" + "d" * 11 + "RR"
    with pytest.raises(ValueError, match="16 blocks"):
        shape("ssdtrain-derive+host10first+recompute7")
    wanted = ["ssdtrain-derive+host5first", "ssdtrain-derive+host3first+recompute2", "ssdtrain-derive+hostx"]
    extra = [p for _, p, _ in llm_rok.plan_jobs(["llama"], ("eager",), wanted)][len(llm_rok.EAGER):]
    assert extra == wanted[:2]


def test_llm_trainer_suite_quick(tmp_path):
    """The Trainer check at a tiny size on CPU: both runs, the same losses, evaluation no step, one plan."""
    pytest.importorskip("transformers")
    out = tmp_path / "trainer.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--suite", "trainer", "--quick", "--device", "cpu", "--csv", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    text = proc.stdout
    assert proc.returncode == 0, text[-3000:] + proc.stderr[-3000:]
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"plain", "ssdtrain@0.8"} and {r["status"] for r in rows.values()} == {"ok"}
    assert "losses (training and evaluation): worst relative difference 0.00e+00 -> MET" in text
    assert "evaluation untouched: steps counted 12 = training micro-batches 12, plans 1 -> MET" in text


def test_block_memory_probe_quick():
    """The block-memory probe runs at a tiny size on CPU and prints a row per block, kept and checkpointed."""
    pytest.importorskip("transformers")
    probe = BENCH.parent / "probe_block_memory.py"
    proc = subprocess.run(
        [sys.executable, str(probe), "--quick", "--device", "cpu", "--checkpointed", "1-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "mean kept:" in proc.stdout and "mean checkpointed:" in proc.stdout
    kinds = [line.split()[1] for line in proc.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert kinds == ["kept", "checkpointed", "kept"]
    proc = subprocess.run(
        [sys.executable, str(probe), "--quick", "--device", "cpu", "--policies"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    ratio = {line.split()[0]: float(line.split()[-2]) for line in proc.stdout.splitlines()[2:]}
    assert ratio["keep"] == 1.0 and 0.3 < ratio["derive"] < 0.6 and ratio["recompute"] < ratio["derive"]


@pytest.mark.parametrize("suite", ["rok", "headline"])
def test_a_policy_name_the_suite_does_not_run_is_an_error(suite):
    """`--policies ssdtrain@recompute` (the suite's name is ssdtrain@recompute*1.0) ran nothing and said so only as
    a missed target at the end of a GPU call: it is refused before anything runs, with the names that exist."""
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--suite", suite, "--policies", "keep,ssdtrain@recompute"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "--policies names ssdtrain@recompute, which the" in proc.stderr and "ssdtrain@keep*0.5" in proc.stderr


def test_host_cost_benchmark_quick(tmp_path):
    """The host-cost benchmark runs every policy at a tiny size and writes a row each, with the pack counts."""
    pytest.importorskip("transformers")
    out = tmp_path / "host_cost.csv"
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "host_cost.py"), "--quick", "--csv", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["policy"]: r for r in csv.DictReader(out.open())}
    assert set(rows) == {"none", "keep", "derive", "host", "derive+host", "recompute", "checkpoint", "keep-each"}
    # Every saved tensor of the model passes ssdtrain's pack hook once (a recomputed block's pass through the
    # checkpoint's own hooks instead; blocks kept whole with nothing moved below run without ssdtrain's hooks), and
    # every one is unpacked by backward.
    assert int(rows["none"]["packs"]) == int(rows["derive"]["packs"]) == int(rows["host"]["packs"]) > 0
    assert int(rows["derive+host"]["packs"]) == int(rows["none"]["packs"])
    assert 0 < int(rows["keep"]["packs"]) < int(rows["none"]["packs"])
    assert int(rows["checkpoint"]["packs"]) <= int(rows["recompute"]["packs"]) < int(rows["none"]["packs"])
    assert all(int(r["unpacks"]) == int(r["packs"]) for r in rows.values())
    assert int(rows["keep-each"]["packs"]) == 0  # a session per micro-batch: its hooks are keep's, not timed again
    assert float(rows["keep-each"]["open_ms"]) > 0 and rows["none"]["open_ms"] == "nan"
    assert all(float(r["fwd_ms"]) > 0 and float(r["bwd_ms"]) > 0 for r in rows.values())
    assert "+us/pack" in proc.stdout
    # (moved: saved tensors sent to a tier per micro-batch, each an entry and a copy out)
    assert int(rows["host"]["moved"]) > int(rows["derive+host"]["moved"]) > 0
    assert int(rows["keep"]["moved"]) == int(rows["derive"]["moved"]) == int(rows["none"]["moved"]) == 0
