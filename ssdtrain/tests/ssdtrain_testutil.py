"""Helpers shared by ssdtrain's tests (a unique module name: the monorepo runs all packages' tests together)."""

import contextlib
import shutil
import subprocess

import pytest
import torch


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
