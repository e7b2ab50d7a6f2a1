"""Probe: what a transformer block holds on the GPU in forward and in backward, kept and checkpointed.

The ssdtrain planner predicts a recomputed block's backward peak as the block's saved bytes (re-created by the
recompute) plus the working memory measured in a kept block's backward. On the ROK suite's Llama model the first
step under a plan with recomputed blocks measured 0.4-1.0 GiB above that prediction. This probe measures, per
block, in one micro-batch with the gradients already held (the accumulation case):
- forward: bytes the block leaves allocated (what it saves) and its temporaries (its peak above that);
- backward: the rise of the allocation during the block's backward above what was allocated when it began,
for the blocks kept and for the blocks checkpointed (non-reentrant, as ssdtrain and HF checkpointing do it).

    python3 ssdtrain/benchmarks/probe_block_memory.py            # the ROK suite's Llama model (CUDA)
    python3 ssdtrain/benchmarks/probe_block_memory.py --quick    # tiny, any device (smoke)
    python3 ssdtrain/benchmarks/probe_block_memory.py --policies # saved bytes per recompute choice (CPU is fine)

``--policies`` profiles one step of a 2-block model of the ROK suite's width (few tokens, under autocast bf16) with
the planner's own profiler and prints, per token and scaled to the suite's micro-batch (4 x 2048 tokens), what one
block saves under each recompute choice: keep, cheap, derive, torch's selective checkpointing, full recompute.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MIB = float(1 << 20)


class Meter:
    """Allocation and peak readings at block boundaries (CUDA's allocator statistics)."""

    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0

    def peak_and_reset(self) -> int:
        if self.device.type != "cuda":
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return peak


def _first_tensor(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def measure(model, blocks, ids, meter: Meter, autocast_dtype) -> list[dict]:
    """One forward+backward of `model` on `ids`: per block, forward saved and temporary bytes, and the allocation's
    rise during its backward."""
    rows = [dict(block=i) for i in range(len(blocks))]
    marks = {}
    hooks = []
    backward_marks: list[tuple[int, int]] = []  # (block whose backward begins, allocated then), in order

    def pre(i):
        def hook(module, args, kwargs=None):
            if not torch.is_grad_enabled():  # (a recompute calls the block's forward, not the module: no hooks)
                return
            meter.peak_and_reset()
            marks[i] = meter.allocated()

        return hook

    def post(i):
        def hook(module, args, output):
            if not torch.is_grad_enabled() or i not in marks:
                return
            peak = meter.peak_and_reset()
            end = meter.allocated()
            rows[i]["saved_mib"] = (end - marks.pop(i)) / MIB
            rows[i]["forward_temporaries_mib"] = max(0, peak - end) / MIB
            t = _first_tensor(output)
            if isinstance(t, torch.Tensor) and t.requires_grad:

                def grad_hook(grad, i=i):
                    peak = meter.peak_and_reset()
                    backward_marks.append((i, meter.allocated(), peak))

                t.register_hook(grad_hook)

        return hook

    for i, b in enumerate(blocks):
        hooks.append(b.register_forward_pre_hook(pre(i)))
        hooks.append(b.register_forward_hook(post(i)))
    try:
        with torch.autocast(meter.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids=ids, labels=ids).loss
        meter.peak_and_reset()
        loss.backward()
        final_peak = meter.peak_and_reset()
    finally:
        for h in hooks:
            h.remove()
    # backward_marks[k] = (i, allocated when block i's backward began, peak since the previous mark): the peak read
    # at block i's mark is the peak of block i+1's backward (or the head's, for the last block).
    for k, (i, start, _) in enumerate(backward_marks):
        peak = backward_marks[k + 1][2] if k + 1 < len(backward_marks) else final_peak
        rows[i]["backward_rise_mib"] = max(0, peak - start) / MIB
    return rows


def checkpoint_block(block) -> None:
    original = block.forward

    def forward(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(original, *args, use_reentrant=False, **kwargs)

    block.forward = forward


def policies(a, llm, llm_budget) -> int:
    """Saved bytes of one block per recompute choice, from the planner's profile of one step (any device)."""
    import ssdtrain

    device = torch.device(a.device)
    size = dict(layers=2, hidden=64 if a.quick else 2048, heads=4 if a.quick else 16, batch=1, seq=a.tokens)
    args = argparse.Namespace(**size, vocab=50257, llama_vocab=512)
    model, _ = llm_budget.build(llm, "llama", args, device, torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, 512, (1, a.tokens), device=device, generator=gen)
    dtype = torch.bfloat16

    def step():
        with torch.autocast(device.type, dtype=dtype):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    plan = ssdtrain.plan(model, step, min_bytes="1K")
    u = plan.units[1]
    scale = 4 * 2048 / a.tokens
    saved = u.saved_bytes + u.small_bytes
    rows = [
        ("keep", saved, 0.0),
        (f"cheap ({', '.join(u.cheap_modules) or 'none'})", saved - u.cheap_bytes, u.cheap_s),
        ("derive", saved - u.derive_bytes, u.derive_s),
        ("selective (torch SAC)", u.selective_bytes + u.input_bytes, u.selective_s),
        ("recompute", u.input_bytes, u.forward_s),
    ]
    casts = u.pinned_bytes / MIB
    print(f"# one block of llama {size} under autocast {dtype} on {device}; weight casts {casts:.1f} MiB")
    print(f"{'choice':<48} {'B/token':>9} {'MiB/micro-batch':>16} {'x keep':>7} {'recompute ms (here)':>20}")
    for name, nbytes, seconds in rows:
        print(
            f"{name:<48} {nbytes / a.tokens:9.0f} {nbytes * scale / MIB:16.1f} {nbytes / saved:7.2f} "
            f"{seconds * 1e3:20.2f}"
        )
    return 0


def main(argv=None) -> int:
    import llm
    import llm_budget

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test; CPU is fine)")
    p.add_argument("--policies", action="store_true", help="saved bytes of one block per recompute choice")
    p.add_argument("--tokens", type=int, default=64, help="tokens of the --policies step (bytes scale with them)")
    p.add_argument("--device", default="auto", help="cuda, cpu or auto")
    p.add_argument("--checkpointed", default="4-11", help="blocks to checkpoint, e.g. 4-11 (the rest are kept)")
    a = p.parse_args(argv)
    if a.device == "auto":
        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    if a.policies:
        return policies(a, llm, llm_budget)
    device = torch.device(a.device)
    size = (
        dict(layers=3, hidden=64, heads=4, batch=2, seq=64)
        if a.quick
        else dict(layers=16, hidden=2048, heads=16, batch=4, seq=2048)
    )
    args = argparse.Namespace(**size, vocab=50257, llama_vocab=512 if a.quick else 32000)
    model, cfg = llm_budget.build(llm, "llama", args, device, torch.float32)
    blocks = llm.blocks_of(model)
    lo, _, hi = a.checkpointed.partition("-")
    chosen = set(range(int(lo), int(hi or lo) + 1)) & set(range(len(blocks)))
    for i in chosen:
        checkpoint_block(blocks[i])
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device, generator=gen)
    meter = Meter(device)
    dtype = torch.bfloat16 if device.type == "cuda" else None
    measure(model, blocks, ids, meter, dtype)  # warm-up: allocates the gradients (held, as under accumulation)
    rows = measure(model, blocks, ids, meter, dtype)
    print(f"# block memory, llama {size}, autocast {dtype}, gradients held; checkpointed blocks {sorted(chosen)}")
    print(f"{'block':>5} {'kind':>12} {'saved MiB':>10} {'fwd temp MiB':>13} {'bwd rise MiB':>13}")
    for r in rows:
        kind = "checkpointed" if r["block"] in chosen else "kept"
        print(
            f"{r['block']:>5} {kind:>12} {r.get('saved_mib', 0):10.1f} {r.get('forward_temporaries_mib', 0):13.1f} "
            f"{r.get('backward_rise_mib', 0):13.1f}"
        )
    keys = ("saved_mib", "forward_temporaries_mib", "backward_rise_mib")
    for kind in ("kept", "checkpointed"):
        members = [r for r in rows if (r["block"] in chosen) == (kind == "checkpointed")]
        if members:
            mean = {k: sum(r.get(k, 0) for r in members) / len(members) for k in keys}
            print(
                f"mean {kind}: saved {mean['saved_mib']:.1f} MiB, forward temporaries "
                f"{mean['forward_temporaries_mib']:.1f} MiB, backward rise {mean['backward_rise_mib']:.1f} MiB"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
