"""The one settings style: parsers, precedence (setter > environment at import > default), errors that name the
variable and the valid values, and each package README's table generated from the package's own table."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
FOLDER = {"pytorch_direct": "pytorch-direct", "hector": "hector", "ssdtrain": "ssdtrain"}


@pytest.mark.parametrize("text, value", [("1", True), ("true", True), ("ON", True), ("0", False), ("False", False),
                                         ("off", False), (True, True), (False, False)])
def test_booleans_spelled_one_way(shared, text, value):
    assert shared.parse_bool(text) is value
    assert shared.parse_tristate(text) == ("on" if value else "off")


@pytest.mark.parametrize("text", ["yes", "2", "", "enabled"])
def test_bad_booleans_name_the_valid_values(shared, text):
    with pytest.raises(ValueError, match="true.*off"):
        shared.parse_bool(text)
    assert shared.parse_tristate("AUTO") == "auto"


@pytest.mark.parametrize("value, size", [(4096, 4096), ("4096", 4096), ("1M", 1 << 20), ("1.5GiB", 3 << 29),
                                         (1e9, 10**9), ("0", 0)])
def test_sizes(shared, value, size):
    assert shared.parse_size(value) == size


@pytest.mark.parametrize("value", [0.5, "0.5", "1.5", -1, "12Q"])
def test_a_size_that_is_no_whole_number_of_bytes_is_refused(shared, value):
    """0.5 (a fraction, as a budget takes) read as 0 bytes would switch a tier off without a word."""
    with pytest.raises(ValueError, match="whole number|>= 0|K, M, G or T"):
        shared.parse_size(value)


def test_precedence_and_errors(shared, monkeypatch):
    table = {"depth": shared.Setting("TOY_DEPTH", 32, shared.integer(1), "requests in flight", "toy.set_depth"),
             "size": shared.Setting("TOY_SIZE", 1 << 20, shared.parse_size, "bytes", "toy.set_size", "`1M`")}
    monkeypatch.setenv("TOY_DEPTH", "8")
    settings = shared.Settings(table)
    assert settings.depth == 8 and settings.size == 1 << 20
    monkeypatch.setenv("TOY_DEPTH", "16")
    assert settings.depth == 8  # read at creation (import), not at each use
    settings.reload()
    assert settings.depth == 16
    settings.set("depth", "4")
    assert settings.depth == 4
    settings.set("depth", None)
    assert settings.depth == 16
    with pytest.raises(ValueError, match=r"depth: '0' must be a whole number >= 1"):
        settings.set("depth", "0")
    monkeypatch.setenv("TOY_SIZE", "12Q")
    with pytest.raises(ValueError, match=r"TOY_SIZE='12Q'.*K, M, G or T"):
        settings.reload()
    with pytest.raises(TypeError, match="unknown setting 'speed'"):
        settings.set("speed", 1)
    assert "| `TOY_SIZE` | `1M` | `toy.set_size` | bytes |" in settings.markdown()


def test_cache_folders_follow_xdg(shared, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SHARED_CUDA_JIT_CACHE_DIR", raising=False)
    assert shared.cache_home() == tmp_path
    shared.SETTINGS.reload()
    try:
        assert shared.jit_cache_dir() == str(tmp_path / "shared_cuda" / "jit")
    finally:
        monkeypatch.undo()
        shared.SETTINGS.reload()


def test_readme_lists_every_setting(package):
    readme = (REPO / FOLDER[package.__name__] / "README.md").read_text()
    table = package.settings.markdown()
    assert table in readme, f"update the Settings table in {FOLDER[package.__name__]}/README.md to:\n{table}"


def test_root_readme_lists_the_shared_settings(shared):
    table = shared.SETTINGS.markdown()
    assert table in (REPO / "README.md").read_text(), f"update the Settings table in README.md to:\n{table}"
