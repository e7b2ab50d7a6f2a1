"""Both training scripts under torchrun with 2 processes on the gloo backend (the CPU stand-in for NCCL): DDP, one
shared host copy of the GNN features, ssdtrain per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def torchrun(script: str, args: list[str], out: Path) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE / script), "--device", "cpu", "--no-progress", "--json", str(out), *args]
    # one thread per process: two processes share the CI machine's two cores
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTORCH_DIRECT_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


def test_gnn_two_processes_share_one_feature_table(tmp_path):
    # a table of 15 MiB, large enough for the shared-memory reading to tell one copy from two
    report = torchrun("gnn_train.py", ["--size", "tiny", "--num-nodes", "60000", "--feature-dim", "64"],
                      tmp_path / "gnn.json")
    assert report["world_size"] == 2
    assert 0.7 < report["host_feature_copies"] < 1.3, report["host_feature_copies"]
    chance = report["chance_accuracy"]
    for impl in ("toolkit", "baseline"):
        epochs = report["impls"][impl]["epochs"]
        assert epochs[-1]["loss"] < epochs[0]["loss"], impl
        assert epochs[-1]["val_acc"] > 1.5 * chance, (impl, epochs[-1]["val_acc"])
    ours = [v for e in report["impls"]["toolkit"]["epochs"] for v in e["batch_losses"]]
    theirs = [v for e in report["impls"]["baseline"]["epochs"] for v in e["batch_losses"]]
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def test_llm_two_processes_with_ssdtrain(tmp_path):
    report = torchrun("llm_train.py", ["--size", "tiny", "--policies", "keep,ssdtrain"], tmp_path / "llm.json")
    assert report["world_size"] == 2
    runs = {r["policy"]: r for r in report["runs"]}
    assert runs["keep"]["status"] == runs["ssdtrain"]["status"] == "ok"
    # DDP averages gradients: ssdtrain changes where activations live, not the training
    assert runs["ssdtrain"]["losses"] == pytest.approx(runs["keep"]["losses"], abs=1e-4)
    assert runs["keep"]["losses"][-1] < runs["keep"]["losses"][0]
    # tokens/s counts both processes
    assert runs["keep"]["tokens_per_s"] == pytest.approx(
        2 * runs["keep"]["batch"] * report["config"]["model"]["seq_len"] / runs["keep"]["step_s"])


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
def test_gnn_two_gpus_nccl(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               str(HERE / "gnn_train.py"), "--size", "tiny", "--no-progress", "--json", str(tmp_path / "g.json")]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    report = json.loads((tmp_path / "g.json").read_text())
    assert report["world_size"] == 2 and report["device"] == "cuda"
    assert report["impls"]["toolkit"]["epochs"][-1]["val_acc"] > 1.5 * report["chance_accuracy"]
