"""Every C++ exception type reaches Python as the documented exception, with its message."""

import errno

import pytest


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("invalid_argument", ValueError),
        ("out_of_range", IndexError),
        ("bad_alloc", MemoryError),
    ],
)
def test_std_mappings(core, kind, expected):
    with pytest.raises(expected, match=None if kind == "bad_alloc" else "the message"):
        core._raise_for_test(kind, "the message", 0)


def test_cuda_error_is_runtime_error_with_code(core):
    with pytest.raises(core.CudaError, match="cudaMalloc failed") as info:
        core._raise_for_test("cuda", "cudaMalloc failed", 2)
    assert isinstance(info.value, RuntimeError)
    assert info.value.code == 2


def test_compile_error_carries_log(core):
    with pytest.raises(core.CompileError) as info:
        core._raise_for_test("compile", "bad kernel", 0)
    assert isinstance(info.value, RuntimeError)
    assert info.value.log == "log: bad kernel"


def test_unavailable_error(core):
    with pytest.raises(core.UnavailableError, match="no GPU"):
        core._raise_for_test("unavailable", "no GPU", 0)


@pytest.mark.parametrize(
    ("err", "subclass"),
    [(errno.ENOSPC, OSError), (errno.ENOENT, FileNotFoundError), (errno.EACCES, PermissionError)],
)
def test_io_error_is_oserror_with_errno(core, err, subclass):
    with pytest.raises(subclass) as info:
        core._raise_for_test("io", "write to /x failed", err)
    assert info.value.errno == err
    assert "write to /x failed" in str(info.value)


def test_package_reexports_exception_types(package, core):
    assert package.CudaError is core.CudaError
    assert package.CompileError is core.CompileError
    assert package.UnavailableError is core.UnavailableError


def test_unknown_kind_is_value_error(core):
    with pytest.raises(ValueError, match="unknown error kind"):
        core._raise_for_test("nonsense", "", 0)
