"""Training a GPT- or Llama-style language model (Hugging Face ``transformers``, built from a config) for N steps with
ssdtrain's activation offloading under a memory budget, beside the plain way (every activation kept on the GPU),
on the same data and initial weights.

The plain way is measured at growing batch sizes until it runs out of memory; ssdtrain then trains a batch 1.5x
the largest that fitted (``--ssdtrain-batch auto``), a configuration that does not fit without offloading.
Reported per run: step time, tokens/s, peak device memory (total, and the activations' share above weights,
gradients and optimizer state), the loss curve, and ssdtrain's own counters.

    python integration-tests/llm_train.py --size tiny                     # CPU, seconds
    python integration-tests/llm_train.py --size large --json out.json    # one GPU
    torchrun --nproc-per-node=2 integration-tests/llm_train.py --size large --policies ssdtrain --ssdtrain-batch 24

Under torchrun every process trains its own batch on its own GPU (DDP); ssdtrain's host pool and NVMe files are per
process. Batch sizes are per process; tokens/s counts all processes.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
import traceback

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import harness

POLICIES = ("keep", "recompute", "ssdtrain")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # gpt2 | llama
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int


@dataclasses.dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    batch_sizes: tuple[int, ...]  # the plain way's sweep (stops at the first that does not fit)
    steps: int
    warmup: int  # untimed first steps (ssdtrain profiles the first two forwards, then plans)
    lr: float
    budget: str | None  # ssdtrain's activation budget; None: its fastest plan that fits the device
    scale: float = 1.5  # ssdtrain's (and recompute's) batch over the largest keep fitted
    min_bytes: str | None = None  # ssdtrain's smallest saved tensor worth moving (None: its default, 1 MiB)


# tiny: a CPU in seconds (ssdtrain under a budget of a fraction of keep's activations, at keep's batch so that the
# losses compare step by step).
# small: the demo on one GPU. large: the GPU machine -- a 1.3B-parameter GPT-2 at 2048 tokens, bf16.
SIZES = {
    "tiny": RunConfig(ModelConfig("gpt2", layers=2, hidden=64, heads=4, vocab=512, seq_len=64),
                      batch_sizes=(4,), steps=16, warmup=3, lr=2e-3, budget="3MiB", scale=1.0,
                      min_bytes="4KiB"),
    "small": RunConfig(ModelConfig("gpt2", layers=12, hidden=768, heads=12, vocab=50_304, seq_len=1024),
                       batch_sizes=(8, 16, 32, 48, 64, 96, 128), steps=12, warmup=3, lr=3e-4, budget=None),
    "large": RunConfig(ModelConfig("gpt2", layers=24, hidden=2048, heads=16, vocab=50_304, seq_len=2048),
                       batch_sizes=(8, 12, 16, 20, 24, 32), steps=9, warmup=3, lr=1e-4, budget=None),
}


def build_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """A freshly initialised model (the same weights for the same seed), dropout off (runs comparable step by
    step), SDPA attention."""
    import transformers

    if cfg.arch == "gpt2":
        config = transformers.GPT2Config(n_layer=cfg.layers, n_embd=cfg.hidden, n_head=cfg.heads,
                                         vocab_size=cfg.vocab, n_positions=cfg.seq_len, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        cls = transformers.GPT2LMHeadModel
    elif cfg.arch == "llama":
        config = transformers.LlamaConfig(num_hidden_layers=cfg.layers, hidden_size=cfg.hidden,
                                          intermediate_size=int(cfg.hidden * 8 / 3 + 63) // 64 * 64,
                                          num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                                          vocab_size=cfg.vocab, max_position_embeddings=cfg.seq_len)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"unknown architecture {cfg.arch!r}: gpt2 or llama")
    config._attn_implementation = "sdpa"
    config.use_cache = False
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    model.loss_type = "ForCausalLM"  # what transformers picks anyway, named so that it does not warn
    return model.to(dtype)


def token_batch(cfg: ModelConfig, batch: int, step: int, rank: int, seed: int, device: torch.device) -> torch.Tensor:
    """Synthetic text that can be learned: Zipf-distributed tokens (a unigram model pays at once) in phrases of 32
    tokens repeated along the sequence with 10% of the tokens replaced (copying pays once the model has induction
    heads). The same (step, rank, seed) gives the same batch."""
    gen = torch.Generator(device).manual_seed(seed * 1_000_003 + step * 1009 + rank)
    phrase_len = 32

    def zipf(shape):
        return (torch.rand(shape, generator=gen, device=device).pow(3.0) * cfg.vocab).long().clamp(max=cfg.vocab - 1)

    phrases = zipf((batch, phrase_len))
    tokens = phrases.repeat(1, math.ceil(cfg.seq_len / phrase_len))[:, : cfg.seq_len]
    noise = torch.rand(tokens.shape, generator=gen, device=device) < 0.1
    return torch.where(noise, zipf(tokens.shape), tokens)


def model_flops_per_token(cfg: ModelConfig, params: int) -> float:
    """6 N + 12 L H S: training FLOPs per token (weights and attention), for the achieved-TFLOP/s column."""
    return 6.0 * params + 12.0 * cfg.layers * cfg.hidden * cfg.seq_len


def run_policy(policy: str, batch: int, run: RunConfig, proc: harness.Process, args) -> dict:
    """Train ``run.steps`` steps from fresh weights; returns timings, memory and losses, or status "out of memory"
    (single process only: under torchrun an out-of-memory error ends the job)."""
    device, cfg = proc.device, run.model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    record = {"policy": policy, "batch": batch, "seq_len": cfg.seq_len, "world_size": proc.world_size}
    model = train_model = optimizer = session = None
    try:
        model = build_model(cfg, device, dtype, args.seed)
        record["parameters"] = sum(p.numel() for p in model.parameters())
        if policy == "recompute":
            enable_recompute(model)
        train_model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
            if proc.distributed else model
        optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr)
        harness.synchronize(device)
        losses, times = [], []
        harness.reset_peak_memory(device)
        resident = None
        session = offload_session(policy, model, run, args)
        bar = harness.progress(run.steps, f"{policy} batch {batch}", proc.main and not args.no_progress)
        with session if session is not None else _nothing(), bar:
            for step in range(run.steps):
                tokens = token_batch(cfg, batch, step, proc.rank, args.seed, device)
                begin = harness.now(device)
                if step == 1 and device.type == "cuda":
                    # weights and optimizer state exist now: the peak above them is the activations (and the
                    # gradients as backward creates them)
                    resident = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                loss = train_model(input_ids=tokens, labels=tokens).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                losses.append(loss.detach())
                times.append(harness.now(device) - begin)
                bar.set_postfix_str(f"{times[-1] * 1e3:.0f} ms/step", refresh=False)
                bar.update(1)
        record["status"] = "ok"
        record["losses"] = [v / proc.world_size for v in proc.sum([float(x) for x in losses])]
        timed = times[run.warmup:] or times
        step_s = proc.max([statistics.median(timed)])[0]
        tokens_per_step = batch * cfg.seq_len * proc.world_size
        record.update({
            "step_times_s": times, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "tflops": model_flops_per_token(cfg, record["parameters"]) * tokens_per_step / step_s / 1e12,
            "first_step_s": times[0],
        })
        peak = harness.peak_memory(device)
        if peak is not None:
            record["peak_bytes"] = proc.max([peak])[0]
            record["activation_peak_bytes"] = proc.max([peak - (resident or 0)])[0]
        if session is not None:
            record["ssdtrain"] = session_report(session)
    except Exception as error:  # noqa: BLE001 - one failed run must not lose the others' results
        if proc.distributed:
            raise  # the other processes wait in collectives: end the job (torchrun stops them)
        record["status"] = "out of memory" if _out_of_memory(error) else "failed"
        record["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
        if record["status"] == "failed":
            traceback.print_exc()
    finally:
        del model, train_model, optimizer, session  # free the device memory before the next run is built
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def _out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or a library's allocation failure reported as a RuntimeError (cuBLAS, NCCL)."""
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in text or "ALLOC_FAILED" in text


def enable_recompute(model: nn.Module) -> None:
    """Hugging Face's gradient checkpointing of every block (the name changed in transformers 5.2x)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def offload_session(policy: str, model: nn.Module, run: RunConfig, args):
    """ssdtrain's context for the ``ssdtrain`` policy (None for the others)."""
    if policy != "ssdtrain":
        return None
    import ssdtrain

    budget = args.budget if args.budget is not None else run.budget
    options = {"host_memory": args.host_memory} if args.host_memory else {}
    if run.min_bytes is not None:
        options["min_bytes"] = run.min_bytes
    return ssdtrain.offload(model, budget=budget, verbose=False, **options)


def session_report(session) -> dict:
    stats = session.stats()
    report = {"stats": stats}
    if getattr(session, "plan", None) is not None:
        report["plan"] = str(session.plan)
    return report


def sweep_and_train(run: RunConfig, proc: harness.Process, args, runs: list[dict], on_run=lambda: None) -> None:
    """Appends each run's record to ``runs`` as it finishes (and calls ``on_run``)."""
    policies = [p for p in POLICIES if p in args.policies]
    largest_keep = None
    if "keep" in policies:
        for batch in run.batch_sizes:
            record = run_policy("keep", batch, run, proc, args)
            runs.append(record)
            print_run(record, proc)
            on_run()
            if record["status"] != "ok":
                break
            largest_keep = batch
    big = resolve_ssdtrain_batch(args.ssdtrain_batch, largest_keep, run)
    for policy in ("recompute", "ssdtrain"):
        if policy in policies:
            record = run_policy(policy, big, run, proc, args)
            runs.append(record)
            print_run(record, proc)
            on_run()


def resolve_ssdtrain_batch(value: str, largest_keep: int | None, run: RunConfig) -> int:
    if value != "auto":
        return int(value)
    if largest_keep is None:
        return run.batch_sizes[0]
    if largest_keep == run.batch_sizes[-1]:
        return largest_keep  # keep fitted every size tried: compare at the same batch
    return math.ceil(run.scale * largest_keep)


def print_run(r: dict, proc: harness.Process) -> None:
    if r["status"] != "ok":
        proc.print(f"  {r['policy']:9s} batch {r['batch']:4d}: {r['status']} ({r.get('error', '')})")
        return
    proc.print(f"  {r['policy']:9s} batch {r['batch']:4d}: {r['step_s'] * 1e3:9.1f} ms/step {r['tokens_per_s']:11,.0f} "
               f"tokens/s  peak {harness.gib(r.get('peak_bytes')):>10s} (activations "
               f"{harness.gib(r.get('activation_peak_bytes'))})  loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")


def summarize(report: dict, proc: harness.Process) -> None:
    ok = [r for r in report["runs"] if r["status"] == "ok"]
    keep = [r for r in ok if r["policy"] == "keep"]
    best_keep = max(keep, key=lambda r: r["batch"]) if keep else None
    proc.print(f"\n{'policy':10s} {'batch':>5s} {'ms/step':>9s} {'tokens/s':>11s} {'peak':>10s} {'act. peak':>10s} "
               f"{'loss':>7s}")
    for r in report["runs"]:
        if r["status"] != "ok":
            proc.print(f"{r['policy']:10s} {r['batch']:5d} {r['status']:>9s}")
            continue
        proc.print(f"{r['policy']:10s} {r['batch']:5d} {r['step_s'] * 1e3:9.1f} {r['tokens_per_s']:11,.0f} "
                   f"{harness.gib(r.get('peak_bytes')):>10s} {harness.gib(r.get('activation_peak_bytes')):>10s} "
                   f"{r['losses'][-1]:7.3f}")
    for r in ok:
        if r["policy"] != "keep" and best_keep is not None:
            proc.print(f"{r['policy']} at batch {r['batch']} ({r['batch'] / best_keep['batch']:.2f}x the largest "
                       f"batch keep ran): {r['tokens_per_s'] / best_keep['tokens_per_s']:.2f}x keep's tokens/s")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--size", choices=sorted(SIZES), default=None,
                        help="preset (default: small with a GPU, tiny without)")
    parser.add_argument("--policies", default="keep,recompute,ssdtrain",
                        help=f"comma-separated, from {','.join(POLICIES)} (recompute: gradient checkpointing)")
    parser.add_argument("--ssdtrain-batch", default="auto",
                        help="batch per process for ssdtrain and recompute; auto: 1.5x the largest keep fitted "
                             "(tiny: the same)")
    parser.add_argument("--budget", default=None, help="ssdtrain's activation budget, e.g. 40GiB (default: preset)")
    parser.add_argument("--host-memory", default=None,
                        help="ssdtrain's pinned host pool per process, e.g. 96GiB (default: ssdtrain's own)")
    parser.add_argument("--device", default="auto", help='cuda, cpu or auto (cuda when available)')
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--seed", type=int, default=0, help='random seed for weights and data')
    parser.add_argument("--no-progress", action="store_true", help='no progress bars')
    group = parser.add_argument_group("overrides of the preset")
    group.add_argument("--arch", choices=("gpt2", "llama"), help='model family: GPT-2 or Llama-style')
    group.add_argument("--layers", type=int, help='transformer blocks (overrides the preset)')
    group.add_argument("--hidden", type=int, help='hidden size (overrides the preset)')
    group.add_argument("--heads", type=int, help='attention heads (overrides the preset)')
    group.add_argument("--seq-len", type=int, help='tokens per sequence (overrides the preset)')
    group.add_argument("--batch-sizes", help="keep's sweep, e.g. 8,12,16")
    group.add_argument("--steps", type=int, help='training steps per policy (overrides the preset)')
    args = parser.parse_args(argv)
    if args.size is None:
        args.size = "small" if torch.cuda.is_available() and args.device != "cpu" else "tiny"
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}: choose from {', '.join(POLICIES)}")
    return args


def configure(args) -> RunConfig:
    run = SIZES[args.size]
    model = dataclasses.replace(run.model, **{k: getattr(args, k) for k in ("arch", "layers", "hidden", "heads",
                                                                            "seq_len") if getattr(args, k)})
    changes = {"model": model}
    if args.batch_sizes:
        changes["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
    if args.steps:
        changes["steps"] = args.steps
    run = dataclasses.replace(run, **changes)
    if run.steps <= run.warmup:
        raise SystemExit(f"--steps must exceed the {run.warmup} warm-up steps")
    return run


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    run = configure(args)
    proc = harness.start(args.device)
    m = run.model
    proc.print(f"LLM training, size {args.size}: {m.arch} {m.layers} layers x {m.hidden} hidden, {m.heads} heads, "
               f"sequence {m.seq_len}, {run.steps} steps; {proc.world_size} process(es) on {proc.device.type}; "
               f"policies {', '.join(args.policies)}")
    start = time.perf_counter()
    report = {"script": "llm_train", "size": args.size, "world_size": proc.world_size,
              "device": proc.device.type, "environment": harness.environment(),
              "config": dataclasses.asdict(run), "runs": [], "seconds": None}

    def save() -> None:  # after each run: a job stopped later still leaves its results
        report["seconds"] = time.perf_counter() - start
        if proc.main:
            harness.write_json(args.json, report)

    sweep_and_train(run, proc, args, report["runs"], save)
    summarize(report, proc)
    harness.finish(proc)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
