"""The host's time ssdtrain adds to a training step: a CPU proxy for a host-bound GPU step.

    python ssdtrain/benchmarks/host_cost.py                 # Llama-style GQA, 4 blocks x 64, batch 2 x 32
    python ssdtrain/benchmarks/host_cost.py --quick --csv host_cost.csv
    python ssdtrain/benchmarks/host_cost.py --device cuda   # the same host time on a GPU's path (streams, events)

An eager LLM step on a GPU launches thousands of small kernels; where the host thread launching them is late, the
GPU idles. Every saved tensor passes through ssdtrain's pack hook in forward and its unpack hook in backward, and
recipes and recomputed blocks add Python work of their own, so ssdtrain's host time per step is on the GPU's
critical path whenever the step is host-bound. This benchmark measures that host time alone: a tiny Llama-style
model (transformers config, fp32 weights under autocast bf16, like ``llm.py --suite rok``) on the CPU, where every
op is so small that the time is the host's Python and dispatch. Forward and backward of one micro-batch are timed
separately in the thread's CPU time (median over the timed micro-batches, after ssdtrain's profiling and calibration
steps) for:

  none        no ssdtrain
  keep        ssdtrain, every block planned 'keep' (overrides)
  derive      every block 'derive' (elementwise saved tensors kept as recipes)
  host        every block offloaded to host memory (on the CPU the copies are synchronous: their memory traffic is
              in the time too, unlike on a GPU where they run on a side stream)
  derive+host every block 'derive', and what its recipes start from offloaded to host memory (copies as for host)
  recompute   every block recomputed in backward (its forward runs again there)
  checkpoint  no ssdtrain: torch.utils.checkpoint (non-reentrant) around every block, the baseline of ``recompute``
  keep-each   as keep, but a new session around each micro-batch (``offload()`` and its ``with``: what the Trainer
              callback and a context per step do), its opening and closing timed in the forward's and backward's
              columns; against ``keep`` it is the cost of a session per micro-batch

With ``--device cuda`` the model runs on the GPU, still so small that every step is host-bound: the times are then
the host's work on the GPU path (copies issued on side streams, events, the pinned pool), which the CPU proxy does
not have, and the copies' traffic is not in them. The backward there runs in autograd's own thread for the device,
whose CPU time the ``bwd ms`` column (this thread's) does not see: read the unpack column for it.

Columns: ms per micro-batch forward and backward, ms added against ``none`` and that per pack (everything ssdtrain
adds: module hooks, Python saved-tensor hooks at all, recipes' and recomputed blocks' ops; on a shared machine this
difference of two medians is noisy), then, from ``--hook-micro`` more micro-batches: packs and unpacks per micro-batch,
the saved tensors moved to a tier (``moved``: each with an entry and a copy out and back), and the microseconds per
call inside the session's hooks (as autograd calls them: the compiler guard, the recipe search, a recipe's ops in
unpack, a copy; the slowest 2 % of calls left out), and their total per micro-batch; last,
``open ms``: opening and closing a session around the model with no step in it (median of 20), what a session per
micro-batch (``keep-each``, the Trainer callback) adds to each.
``min_bytes`` is 0 so that every saved tensor takes the path it would take at GPU sizes (none is "small").
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import sys
import time
import warnings

import torch

POLICIES = ("none", "keep", "derive", "host", "derive+host", "recompute", "checkpoint", "keep-each")
_CHOICE = {
    "keep": "keep",
    "derive": "derive",
    "host": "host",
    "derive+host": "derive+host",
    "recompute": "recompute",
    "keep-each": "keep",
}


def build_model(a):
    import llm  # (this script's folder is on sys.path)

    cls, cfg = llm.model_config("llama", argparse.Namespace(**vars(a), llama_vocab=a.vocab), a.kv_heads)
    # A narrower MLP than the GPU benchmark's (rounded to 8, not 256): at these sizes the host's time is the point.
    cfg.intermediate_size = int(a.hidden * 8 / 3 + 7) // 8 * 8
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    model = cls(cfg).to(a.device)
    model.train()
    return model


def _micro(model, ids, timed: list | None = None, session=None) -> None:
    """One micro-batch; `session`: a function opening a session for it (entered before the forward, closed after
    the backward, both in the timed columns)."""
    # The CPU time of this thread, not wall time: the host's own work, without the time other processes on a
    # shared machine take the core away (torch runs one thread here, and a CPU backward runs on the caller's).
    t0 = time.thread_time()
    with session() if session is not None else contextlib.nullcontext():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        t1 = time.thread_time()
        loss.backward()
    t2 = time.thread_time()
    if timed is not None:
        timed.append((t1 - t0, t2 - t1))


def _count_plain(model, ids) -> tuple[int, int]:
    n = [0, 0]

    def pack(t):
        n[0] += 1
        return t

    def unpack(t):
        n[1] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        _micro(model, ids)
    return n[0], n[1]


class _Policy:
    """One policy's model and session. The sessions stay open through the run so that the policies' micro-batches
    can be interleaved (rounds: machine noise then hits every policy alike); only the session whose micro-batch
    runs has its saved-tensor hooks on autograd's stack (each session's module hooks see only its own model)."""

    def __init__(self, policy: str, a):
        import ssdtrain

        self.policy = policy
        self.model = build_model(a)
        self.ids = torch.randint(0, a.vocab, (a.batch, a.seq), device=a.device)
        self.timed: list = []
        self.session = None
        self.options = None
        self.each = None  # keep-each: opens the micro-batch's session
        if policy == "checkpoint":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # transformers 5 renames it; the old name still works
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif policy != "none":
            _, blocks = ssdtrain.find_blocks(self.model)
            overrides = {name: _CHOICE[policy] for name, _ in blocks}
            self.options = dict(overrides=overrides, min_bytes=0, host_memory="1GiB", nvme_memory=0)
            if policy == "keep-each":
                self.each = lambda: ssdtrain.offload(self.model, **self.options)
                for _ in range(self.each().settling_steps):
                    self.micro()
                return
            self.session = ssdtrain.offload(self.model, **self.options).__enter__()
            for _ in range(self.session.settling_steps):
                self.micro()
            self._hooks().__exit__(None, None, None)

    def _hooks(self):
        return self.session._saved_hooks  # the session's saved_tensors_hooks context (re-entered per round)

    def micro(self, timed: list | None = None) -> None:
        _micro(self.model, self.ids, timed, self.each)
        self.model.zero_grad(set_to_none=True)

    def round(self, warmup: int, n: int) -> None:
        if self.session is not None:
            self._hooks().__enter__()
        try:
            for _ in range(warmup):
                self.micro()
            for _ in range(n):
                self.micro(self.timed)
        finally:
            if self.session is not None:
                self._hooks().__exit__(None, None, None)

    def finish(self, hook_micro: int) -> dict:
        """The row: median times, and for ssdtrain policies `hook_micro` more micro-batches with every call through
        the session's saved-tensor hooks (as autograd calls them, compiler guard included) counted and timed."""
        pack_us = unpack_us = float("nan")
        moved = 0
        if self.session is None:
            packs, unpacks = _count_plain(self.model, self.ids)  # (checkpoint: its own hooks take the blocks')
            if self.each is not None:  # (its hooks are not timed: they are keep's)
                packs = unpacks = 0
            plan = ""
        else:
            hooks = self._hooks()
            pack_fn, unpack_fn = hooks.pack_hook, hooks.unpack_hook
            packed, unpacked = [], []
            clock = time.perf_counter_ns

            def pack(x):
                t0 = clock()
                out = pack_fn(x)
                packed.append(clock() - t0)
                return out

            def unpack(x):
                t0 = clock()
                out = unpack_fn(x)
                unpacked.append(clock() - t0)
                return out

            hooks.pack_hook, hooks.unpack_hook = pack, unpack
            stored = self.session.cache.counters["packed_tensors"]
            try:
                self.round(0, hook_micro)
            finally:
                hooks.pack_hook, hooks.unpack_hook = pack_fn, unpack_fn
            moved = (self.session.cache.counters["packed_tensors"] - stored) // hook_micro
            packs, unpacks = len(packed) // hook_micro, len(unpacked) // hook_micro
            pack_us, unpack_us = _per_call_us(packed, packs), _per_call_us(unpacked, unpacks)
            hooks.__enter__()
            plan = str(self.session.plan.as_dict() if self.session.plan is not None else "")
            self.session.__exit__(None, None, None)
        open_ms = self._open_ms() if self.options is not None else float("nan")
        fwd = statistics.median(f for f, _ in self.timed) * 1e3
        bwd = statistics.median(b for _, b in self.timed) * 1e3
        return dict(
            policy=self.policy,
            fwd_ms=fwd,
            bwd_ms=bwd,
            packs=packs,
            unpacks=unpacks,
            moved=moved,
            pack_us=pack_us,
            unpack_us=unpack_us,
            open_ms=open_ms,
            plan=plan,
        )

    def _open_ms(self, n: int = 20) -> float:
        """Median ms (thread CPU time) of opening and closing a session around the model with no step in it: what a
        session per micro-batch adds to each (the model's structure is read once and then reused, see
        ``ssdtrain.model.model_structure``)."""
        import ssdtrain

        times = []
        for _ in range(n):
            t0 = time.thread_time()
            with ssdtrain.offload(self.model, **self.options):
                pass
            times.append(time.thread_time() - t0)
        return statistics.median(times) * 1e3


def _per_call_us(ns: list[int], per_micro: int) -> float:
    """Mean microseconds per hook call, without the slowest 2 % (calls during which the core was taken away)."""
    if not ns or not per_micro:
        return float("nan")
    kept = sorted(ns)[: max(1, int(len(ns) * 0.98))]
    return sum(kept) / len(kept) / 1e3


def run_policies(policies: list[str], a) -> list[dict]:
    runners = [_Policy(x, a) for x in policies]
    per_round = max(1, a.micro // a.rounds)
    for _ in range(a.rounds):
        for r in runners:
            r.round(a.warmup, per_round)
    return [r.finish(a.hook_micro) for r in runners]


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, host time of the GPU path"
    return "CPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (small: the host's time dominates)")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (fewer than --heads: grouped-query)")
    p.add_argument("--batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size")
    p.add_argument("--warmup", type=int, default=1, help="untimed micro-batches per policy and round")
    p.add_argument("--micro", type=int, default=60, help="timed micro-batches per policy (over all rounds)")
    p.add_argument("--hook-micro", type=int, default=10, help="micro-batches with the hook calls timed (per policy)")
    p.add_argument("--rounds", type=int, default=6, help="rounds over the policies, each a share of --micro")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: the host's own time, less noise)")
    p.add_argument("--device", default="cpu", help="cpu (the proxy), or cuda: the GPU path's host time")
    p.add_argument("--quick", action="store_true", help="tiny run (the smoke test)")
    p.add_argument("--csv", help="write the table as CSV here")
    a = p.parse_args(argv)
    if a.quick:
        a.layers, a.hidden, a.seq, a.micro, a.warmup, a.rounds, a.hook_micro = 2, 32, 16, 2, 1, 2, 1
    policies = [x for x in a.policies.split(",") if x]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        p.error(f"unknown policies {unknown}; choose from {', '.join(POLICIES)}")
    torch.set_num_threads(a.threads)
    print(
        f"# ssdtrain host cost ({_device_name(a.device)}, torch {torch.__version__}, {a.threads} thread(s)): "
        f"Llama-style {a.layers} x {a.hidden}, {a.heads} heads / {a.kv_heads} kv, batch {a.batch} x {a.seq}, "
        f"fp32 weights + autocast bf16; median of {a.micro} micro-batches per policy, interleaved in {a.rounds} rounds",
        flush=True,
    )
    rows = run_policies(policies, a)
    base = next((r for r in rows if r["policy"] == "none"), None)
    for r in rows:
        added_f = r["fwd_ms"] - base["fwd_ms"] if base else float("nan")
        added_b = r["bwd_ms"] - base["bwd_ms"] if base else float("nan")
        r["added_fwd_ms"], r["added_bwd_ms"] = added_f, added_b
        r["added_us_per_pack"] = (added_f + added_b) * 1e3 / r["packs"] if r["packs"] and r is not base else 0.0
    header = f"{'policy':<11} {'fwd ms':>8} {'bwd ms':>8} {'+fwd ms':>8} {'+bwd ms':>8} {'packs':>6} {'unpacks':>7}"
    header += f" {'moved':>5}"
    print(header + f" {'+us/pack':>9} {'pack us':>8} {'unpack us':>9} {'hooks ms':>9} {'open ms':>8}")
    for r in rows:
        r["hooks_ms"] = (r["pack_us"] * r["packs"] + r["unpack_us"] * r["unpacks"]) / 1e3
        print(
            f"{r['policy']:<11} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} {r['added_fwd_ms']:8.2f} "
            f"{r['added_bwd_ms']:8.2f} {r['packs']:6d} {r['unpacks']:7d} {r['moved']:5d} {r['added_us_per_pack']:9.1f} "
            f"{r['pack_us']:8.2f} {r['unpack_us']:9.2f} {r['hooks_ms']:9.3f} {r['open_ms']:8.2f}"
        )
    if a.device == "cpu" and any(r["policy"] in ("host", "derive+host") for r in rows):
        print("# host: on the CPU the copies to host memory are synchronous (their traffic is in the time)")
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
