"""Helpers shared by ssdtrain's tests (a unique module name: the monorepo runs all packages' tests together)."""

import contextlib
import shutil
import subprocess

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


@contextlib.contextmanager
def mounted_tmpfs(path, size: str, options: str = ""):
    """A small tmpfs at `path` (needs CAP_SYS_ADMIN); skips the test where mounting is refused."""
    if shutil.which("mount") is None:
        pytest.skip("no mount command here; the fault-injection tests cover this case")
    path.mkdir(parents=True, exist_ok=True)
    opts = f"size={size}" + (f",{options}" if options else "")
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(
            f"cannot mount a tmpfs here ({result.stderr.strip() or result.returncode}); "
            "the fault-injection tests cover this case"
        )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class LiveBytes(TorchDispatchMode):
    """CPU memory held by the tensors ops allocate while this mode is active, and its peaks: a stand-in, on a machine
    without a GPU, for the device's allocated / peak statistics that the session plans and calibrates with (see
    ``measured_cpu_memory``). Each new storage an op outputs (not a view or an in-place result of an input) counts
    until it is freed (a weak reference to it expires), whoever holds it: autograd's saved tensors, gradients.
    Storages made before (parameters), memory allocated outside torch's ops and what `untracked` functions allocate
    are not counted, so on CPU this is the memory a GPU would hold. Two peaks: ``peak`` is the device statistic the
    session reads and resets (as torch.cuda's), ``high`` is a test's own (``reset_high``)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.total = 0
        self.peak = 0
        self.high = 0

    @staticmethod
    def _storages(tree) -> dict:
        out = {}
        for t in tree_leaves(tree):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.layout == torch.strided:
                storage = t.untyped_storage()
                if storage.data_ptr():
                    out[storage.data_ptr()] = storage
        return out

    def _drop_freed(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.total -= self.live.pop(key)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._drop_freed()
        inputs = self._storages((args, kwargs))
        for key, storage in self._storages(out).items():
            if key not in inputs and key not in self.live:
                self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                self.total += storage.nbytes()
        self.peak = max(self.peak, self.total)
        self.high = max(self.high, self.total)
        return out

    def untracked(self, fn):
        """`fn` whose results are host memory, not the device's (ssdtrain's host pool: on CPU both are CPU tensors):
        neither counted nor in the peaks."""

        def call(*args, **kwargs):
            peak, high = self.peak, self.high
            result = fn(*args, **kwargs)
            for key in self._storages(result):
                if key in self.live:
                    self.total -= self.live.pop(key)[1]
            self.peak, self.high = max(peak, self.total), max(high, self.total)
            return result

        return call

    def allocated(self) -> int:
        self._drop_freed()
        return self.total

    def reset_peak(self) -> None:
        self.peak = self.allocated()

    def reset_high(self) -> None:
        self.high = self.allocated()


@contextlib.contextmanager
def measured_cpu_memory(monkeypatch):
    """Sessions measure the CPU memory of a `LiveBytes` as they would a GPU's (profiled working memory, calibration by
    measured peaks) while the block runs; yields the `LiveBytes` (a test reads its own peak: ``high``). The host
    pool's chunks are host memory, not counted."""
    from ssdtrain import hostpool
    from ssdtrain.profiler import DeviceMemory

    live = LiveBytes()
    monkeypatch.setattr(DeviceMemory, "can_measure", lambda self: True)
    monkeypatch.setattr(DeviceMemory, "allocated", lambda self: live.allocated())
    monkeypatch.setattr(DeviceMemory, "max_allocated", lambda self: live.peak)
    monkeypatch.setattr(DeviceMemory, "reset_peak", lambda self: live.reset_peak())
    monkeypatch.setattr(DeviceMemory, "free", lambda self: 1 << 40)
    monkeypatch.setattr(hostpool, "huge_empty", live.untracked(hostpool.huge_empty))
    with live:
        yield live


def random_tensor(nbytes: int, seed: int = 0, dtype=torch.uint8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), generator=g, dtype=torch.uint8).view(dtype)


def encoder_decoder(name: str, vocab_size: int = 211):
    """A tiny T5 or BART (no dropout) and the names of its two lists of blocks."""
    transformers = pytest.importorskip("transformers")
    if name == "t5":
        config = transformers.T5Config(
            d_model=64,
            d_ff=128,
            num_layers=3,
            num_decoder_layers=3,
            num_heads=4,
            d_kv=16,
            vocab_size=vocab_size,
            decoder_start_token_id=0,
            dropout_rate=0.0,
        )
        return transformers.T5ForConditionalGeneration(config), ("encoder.block", "decoder.block")
    config = transformers.BartConfig(
        d_model=64,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    return transformers.BartForConditionalGeneration(config), ("model.encoder.layers", "model.decoder.layers")
