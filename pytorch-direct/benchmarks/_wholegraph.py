"""WholeGraph (``pylibwholegraph``, RAPIDS) as a baseline for ``gather.py``: its gather from a table in host memory
(a "continuous" WholeMemory tensor at location "cpu", read by its GPU kernel), and the same table behind its
device cache (a WholeMemory embedding with the "local_device" cache policy).

Everything fails soft: when pylibwholegraph cannot be imported or set up, or a table cannot be made, the reason is
printed once and its columns stay empty (NaN), and the benchmark goes on. Written from pylibwholegraph's public
Python API (``pylibwholegraph.torch``: ``init_torch_env_and_create_wm_comm``, ``create_wholememory_tensor``,
``create_embedding``, ``create_builtin_cache_policy``, ``WholeMemoryTensor.gather``/``get_local_tensor``).
"""

from __future__ import annotations

import os
import socket

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WholeGraph:
    """One process, one GPU: a WholeGraph world of size 1. :attr:`reason` says why it is unavailable (None: it
    works). ``load`` makes its tables from ours for one (table, row width) group; ``gather`` and ``gather_cached``
    are the two columns; ``drop`` frees the group's tables."""

    def __init__(self, cache_ratio: float = 0.2) -> None:
        self.reason: str | None = None
        self.cache_ratio = cache_ratio
        self.wg = None
        self.comm = None
        self.tensor = None
        self.embedding = None
        try:
            import pylibwholegraph.torch as wgth
        except Exception as e:  # noqa: BLE001 - any import failure (missing wheel, ABI, libraries) is a reason
            self.reason = f"pylibwholegraph is not importable ({type(e).__name__}: {e})"
            return
        try:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("LOCAL_RANK", "0")
            threads = torch.get_num_threads()
            device = torch.cuda.current_device()
            self.comm, _ = wgth.init_torch_env_and_create_wm_comm(0, 1, device, 1, wm_log_level="warn")
            # (its setup sets torch's CPU threads to 1, which would slow the torch baselines measured beside it)
            torch.set_num_threads(threads)
            self.wg = wgth
        except Exception as e:  # noqa: BLE001
            self.reason = f"pylibwholegraph could not be set up ({type(e).__name__}: {e})"

    @staticmethod
    def _dtype(table: torch.Tensor) -> tuple[torch.Tensor, torch.dtype]:
        """The table as WholeGraph can hold it: uint8 rows as int8 (same bytes)."""
        if table.dtype == torch.uint8:
            return table.view(torch.int8), torch.int8
        return table, table.dtype

    def load(self, table: torch.Tensor) -> None:
        """Copies `table` (2-D, host) into a host-memory WholeMemory tensor and a cached WholeMemory embedding."""
        self.drop()
        if self.reason is not None:
            return
        src, dtype = self._dtype(table)
        rows, width = src.shape
        try:
            self.tensor = self.wg.create_wholememory_tensor(self.comm, "continuous", "cpu", [rows, width], dtype,
                                                            None)
            local, offset = self.tensor.get_local_tensor(host_view=True)
            local.copy_(src[offset: offset + local.shape[0]])
        except Exception as e:  # noqa: BLE001
            self.reason = f"pylibwholegraph could not make a host-memory table ({type(e).__name__}: {e})"
            self.drop()
            return
        try:
            policy = self.wg.create_builtin_cache_policy("local_device", "continuous", "cpu", "readonly",
                                                         self.cache_ratio)
            self.embedding = self.wg.create_embedding(self.comm, "continuous", "cpu", dtype, [rows, width],
                                                      cache_policy=policy)
            local, offset = self.embedding.get_embedding_tensor().get_local_tensor(host_view=True)
            local.copy_(src[offset: offset + local.shape[0]])
        except Exception as e:  # noqa: BLE001 - the uncached column can still run
            print(f"# wholegraph_cache: unavailable ({type(e).__name__}: {e})", flush=True)
            self.embedding = None

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        if self.tensor is None:
            raise RuntimeError(self.reason or "no WholeGraph table loaded")
        return self.tensor.gather(idx)

    def gather_cached(self, idx: torch.Tensor) -> torch.Tensor:
        if self.embedding is None:
            raise RuntimeError(self.reason or "no WholeGraph embedding with a cache")
        return self.embedding.gather(idx)

    def drop(self) -> None:
        if self.tensor is not None:
            try:
                self.wg.destroy_wholememory_tensor(self.tensor)
            except Exception:  # noqa: BLE001, S110 - freeing a baseline's table must not stop the benchmark
                pass
        self.tensor = None
        self.embedding = None  # (its memory goes with the Python object)
