"""``session.stats()``: what a session did, from its cache's counters, host pool and NVMe tier."""

from __future__ import annotations


def session_stats(session) -> dict:
    """Counters since the session started: bytes per tier, prefetch hits, forwards, misses, stalls, fallbacks,
    the host pool and the NVMe engine (see the README for each key)."""
    session.cache.read_device_waits()  # (the device's waits for copies out that have ended, into the counters)
    c = session.cache.counters
    pool = session.pool
    nvme = session.nvme.stats()
    return {
        "steps": session.steps,
        "profiled_steps": session.profiled,
        "planned_steps": session.planned_steps,
        "bytes_offloaded": {name: c[f"bytes_to_{name}"] for name, t in session.tiers.items() if not t.resident},
        "bytes_written_to_nvme": (nvme or {}).get("bytes_written", 0),
        "bytes_kept": c["kept_bytes"],
        "tensors_offloaded": c["packed_tensors"],
        "tensors_kept": c["kept_tensors"],  # those of blocks run without the hooks are not counted (next line)
        # Block forwards run with ssdtrain's saved-tensor hooks off: kept whole, nothing moved below them.
        "bare_block_forwards": c["bare_unit_forwards"],
        "tensors_derived": c["derived_tensors"],  # stored as recipes, made again in backward
        # Of those, recipes replayed from a block's template (decided once, checked per tensor) and found by the
        # general search; templates given back to the search where a step's saved tensors differed.
        "derive_replayed": session.cache.deriver.counters["replayed"],
        "derive_searched": session.cache.deriver.counters["general"],
        "derive_template_misses": session.cache.deriver.counters["misses"],
        "param_tensors_kept": c["kept_param_tensors"],
        "views_deduplicated": c["dedup_views"],
        "bytes_restored": c["bytes_restored"],
        "prefetch_hits": c["prefetch_hits"],
        "prefetch_retried": c["prefetch_retried"],  # restored on a second try: in flight at the first
        "forwarded": c["forwarded"],
        "misses": c["misses"],
        # Misses by cause: "not_reached" (the prefetch window had not come to its unit), "in_flight" (its copy
        # out was still running when its unit was prefetched, and done by the time backward used it), "alive"
        # (its original tensor was still alive then).
        "miss_reasons": {k.removeprefix("miss_"): v for k, v in c.items() if k.startswith("miss_")},
        "late_prefetches": c["late_prefetch"],
        "late_bytes": c["late_bytes"],
        "missed_bytes": c["missed_bytes"],
        # Seconds the device's compute waited for copies back that were late or missed (CUDA events).
        "prefetch_wait_seconds": session.cache.read_waits(),
        "host_pin_seconds": session.pool.grow_seconds,
        # Host time inside ssdtrain's saved-tensor hooks, and their calls: pack runs in forward's thread, unpack in
        # backward's (autograd's device thread on a GPU); on a host-bound step this time is the device's too.
        "hook_host_seconds": {k: c[f"{k}_host_ns"] / 1e9 for k in ("pack", "unpack")},
        "hook_calls": {k: c[f"{k}_calls"] for k in ("pack", "unpack")},
        "stalls": c["stalls"],
        "stall_seconds": c["stall_ns"] / 1e9,
        # The device's waits for copies out (its compute stream's; the host goes on): where more bytes wait to leave
        # than the plan allows in flight, and as the last block's forward returns, for the copies out still running
        # (their device bytes released before the head's forward: see ``drain_at_head`` in the plan). Seconds read
        # from CUDA events: waits that have not ended yet are not in them.
        "throttle_waits": c["throttle_waits"],
        "throttle_seconds": c["throttle_ns"] / 1e9,
        "head_drain_waits": c["head_drain_waits"],
        "head_drain_seconds": c["head_drain_ns"] / 1e9,
        "fallbacks": {k.removeprefix("fallback_"): v for k, v in c.items() if k.startswith("fallback_")},
        "host_pool": {
            "limit": pool.limit,
            "reserved": pool.reserved,
            "in_use": pool.in_use,
            "peak_in_use": pool.peak_in_use,
        },
        "peak_device_saved_bytes": session.cache.peak_gpu_saved_bytes,
        "recomputed_modules": session._recomputed,
        "nvme": nvme,
    }
