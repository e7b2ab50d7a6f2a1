"""Sessions for the monorepo. ``nox`` with no arguments runs what CI runs: lint, the C++ tests, each package alone
in its own virtualenv, and the three together.

torch: where no GPU is visible, sessions install ``torch==2.13.0`` (this machine kind has its CPU build as a local
wheel), so nothing pulls a multi-GB CUDA build; with a GPU, ``torch>=2.4``. Set ``TOOLKIT_TORCH_SPEC`` to choose
another requirement (e.g. ``TOOLKIT_TORCH_SPEC="torch==2.11.0"``).

Disk: each session's virtualenv holds its own torch (about 1.2 GB). ``TOOLKIT_NOX_PRUNE=1`` (which ``.ci/run`` sets)
deletes a session's virtualenv as the session ends, so a full run needs room for about two at a time, not seven.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).parent
# distribution folder -> import name
PACKAGES = {"pytorch-direct": "pytorch_direct", "hector": "hector", "ssdtrain": "ssdtrain"}
TORCH_SPEC_ENV = "TOOLKIT_TORCH_SPEC"
PRUNE_ENV = "TOOLKIT_NOX_PRUNE"

nox.options.sessions = ["lint", "cpp", "tests", "readme_install", "integration"]
nox.options.error_on_external_run = True

# package -> (source_key at build time, wheel): the wheels the tests sessions of this nox run built from the
# packages' sdists, which integration installs instead of compiling the same sources again (see source_key).
BUILT_WHEELS: dict[str, tuple[str, Path]] = {}


def gpu_visible() -> bool:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    return subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


def torch_spec() -> str:
    return os.environ.get(TORCH_SPEC_ENV) or ("torch>=2.4" if gpu_visible() else "torch==2.13.0")


def pruned(func):
    """Session decorator: with TOOLKIT_NOX_PRUNE=1, delete the session's virtualenv when it ends, passed or failed
    (CI machines have limited disk; the wheels integration reuses are kept outside the virtualenvs)."""

    @functools.wraps(func)
    def run_then_prune(session: nox.Session, *args, **kwargs):
        try:
            return func(session, *args, **kwargs)
        finally:
            if os.environ.get(PRUNE_ENV) == "1":
                location = Path(session.virtualenv.location)
                session.log(f"{PRUNE_ENV}=1: deleting {location}")
                shutil.rmtree(location, ignore_errors=True)

    return run_then_prune


def wheel_dir(session: nox.Session, package: str) -> Path:
    """Where a tests session keeps its package's wheel for integration: beside the virtualenvs, not inside one."""
    return Path(session.virtualenv.location).parent / "_wheels" / package


def install_torch(session: nox.Session) -> None:
    session.install(torch_spec())


def fresh_build(session: nox.Session) -> list[str]:
    """pip options that build our packages afresh in every session.

    --no-cache-dir: pip caches wheels built from an sdist by its URL, and the sdist is rebuilt at the same path each
    run, so without it a session can install the wheel of an earlier run's code. build-dir: the packages' default
    build folder (<pkg>/build/) is kept between builds for speed; a folder of the session's own keeps CI runs
    independent of earlier ones.
    """
    return ["--no-cache-dir", "-C", f"build-dir={session.create_tmp()}/build/{{wheel_tag}}"]


def source_key(package: str) -> str | None:
    """A hash of everything a package's wheel is built from: the files of its folder and of shared-cuda that git
    tracks or would track, and the environment that steers the build. None outside a git checkout."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", package,
                             "shared-cuda"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode != 0:
        return None
    digest = hashlib.sha256()
    for name in sorted(set(filter(None, listed.stdout.split(b"\0")))):
        path = ROOT / os.fsdecode(name)
        digest.update(name + b"\0" + (path.read_bytes() if path.is_file() else b"-") + b"\0")
    steering = sorted((k, v) for k, v in os.environ.items() if k.startswith(("SHARED_CUDA_", "CMAKE_", "CUDA", "CXX",
                                                                              "CC", "NVCC", "SKBUILD")))
    digest.update(repr((steering, shutil.which("nvcc"))).encode())
    return digest.hexdigest()


def nvrtc_library(session: nox.Session) -> str:
    """Path of libnvrtc from the nvidia-cuda-nvrtc wheel installed in the session's venv ("" when absent)."""
    code = (
        "import importlib.util, pathlib\n"
        "spec = importlib.util.find_spec('nvidia')\n"
        "libs = [p for root in (spec.submodule_search_locations if spec else [])\n"
        "        for sub in ('cu13/lib', 'cuda_nvrtc/lib') for p in pathlib.Path(root, sub).glob('libnvrtc.so*')\n"
        "        if 'builtins' not in p.name]\n"
        "print(libs[0] if libs else '')\n"
    )
    return session.run("python", "-c", code, silent=True).strip()


@nox.session
@pruned
def lint(session: nox.Session) -> None:
    """ruff (Python) and clang-format (C++/CUDA) checks; changes nothing."""
    session.install("ruff", "clang-format==19.1.7")
    session.run("ruff", "check", ".")
    sources = subprocess.run(
        ["git", "ls-files", "*.cpp", "*.hpp", "*.cu", "*.cuh", "*.h"], cwd=ROOT, capture_output=True, text=True,
        check=True,
    ).stdout.split()
    # Snapshots are generated code compared byte for byte with the generator's output, not hand-written C++.
    sources = [s for s in sources if "/snapshots/" not in s]
    if sources:
        session.run("clang-format", "--dry-run", "--Werror", *sources)


@nox.session
@pruned
def cpp(session: nox.Session) -> None:
    """Build shared-cuda on its own (CUDA parts included where nvcc is found) and run its C++ tests under ctest."""
    session.install("cmake>=3.24", "ninja", "nvidia-cuda-nvrtc")
    build = Path(session.create_tmp()) / "shared-cuda-build"
    session.run("cmake", "-S", "shared-cuda", "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release")
    session.run("cmake", "--build", str(build))
    env = {"SHARED_CUDA_NVRTC_PATH": nvrtc_library(session)}
    session.run("ctest", "--test-dir", str(build), "--output-on-failure", env=env)


@nox.session
@nox.parametrize("package", list(PACKAGES))
@pruned
def tests(session: nox.Session, package: str) -> None:
    """One package alone: built from its own sdist into a wheel, installed with only its test extra, then its tests
    and the shared-layer tests run against it. The wheel is kept for integration (see BUILT_WHEELS)."""
    install_torch(session)
    session.install("build")
    key = source_key(package)
    dist = wheel_dir(session, package)
    shutil.rmtree(dist, ignore_errors=True)
    session.run("python", "-m", "build", "--sdist", "--outdir", str(dist), package)
    sdist = next(dist.glob("*.tar.gz"))
    session.run("python", "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dist), sdist.resolve().as_uri(),
                *fresh_build(session))
    wheel = next(dist.glob("*.whl")).resolve()
    session.install(f"{package}[test,nvrtc] @ {wheel.as_uri()}")
    if key is not None and key == source_key(package):
        BUILT_WHEELS[package] = (key, wheel)
    # Separate pytest runs: each test folder has its own conftest module, and one process would mix them up.
    session.run("python", "-m", "pytest", f"{package}/tests", *session.posargs)
    session.run("python", "-m", "pytest", "shared-cuda/python/tests", *session.posargs,
                env={"SHARED_CUDA_TEST_PACKAGE": PACKAGES[package]})


def readme_install_block(package: str) -> list[str]:
    """The commands of the first bash block under "## Install" in the package's README (comments stripped)."""
    text = (ROOT / package / "README.md").read_text()
    match = re.search(r"^## Install\n.*?```bash\n(.*?)```", text, flags=re.S | re.M)
    if match is None:
        raise ValueError(f"{package}/README.md has no '## Install' section with a bash block")
    lines = [line.split("#", 1)[0].strip() for line in match.group(1).splitlines()]
    return [line for line in lines if line]


@nox.session
@nox.parametrize("package", list(PACKAGES))
@pruned
def readme_install(session: nox.Session, package: str) -> None:
    """Each package README's install block, run as written in a fresh virtualenv that has only torch: proves the
    documented install line works for a new user. The C++ parts are built without CUDA here to keep CI short (the
    tests sessions build the CUDA kernels)."""
    install_torch(session)
    for command in readme_install_block(package):
        session.run(*shlex.split(command), env={"SHARED_CUDA_CUDA": "OFF"})


@nox.session
@pruned
def integration(session: nox.Session) -> None:
    """The three packages installed together, then the end-to-end tests. Each package is installed from the wheel
    its tests session built in this nox run where its sources are unchanged since (the same CUDA compile, done
    once), else built from its folder (e.g. ``nox -s integration`` alone). Installing from the folder is what
    readme_install checks."""
    install_torch(session)
    wheels = {p: BUILT_WHEELS[p][1] for p in PACKAGES
              if p in BUILT_WHEELS and BUILT_WHEELS[p][1].exists() and BUILT_WHEELS[p][0] == source_key(p)}
    if wheels:
        session.log(f"installing the tests sessions' wheels of {', '.join(wheels)}")
    session.install(*(f"{p}[test,nvrtc] @ {wheels[p].as_uri()}" if p in wheels else f"./{p}[test,nvrtc]"
                      for p in PACKAGES), *fresh_build(session))
    session.install("-r", "integration-tests/requirements.txt")
    session.run("python", "-m", "pytest", "integration-tests", *session.posargs)
    session.run("python", "-m", "pytest", "shared-cuda/python/tests", *session.posargs)


@nox.session
def demo(session: nox.Session) -> None:
    """Both end-to-end trainings (GNN: pytorch-direct + hector; LLM: ssdtrain), each beside the plain PyTorch/PyG
    way, at the size that fits the machine (tiny on a CPU, small on a GPU); prints the comparison and writes plots to
    integration-tests/demo-output. Arguments after -- go to integration-tests/demo.py (e.g. --size small)."""
    install_torch(session)
    session.install(*(f"./{p}[nvrtc]" for p in PACKAGES), *fresh_build(session))
    session.install("-r", "integration-tests/requirements.txt")
    session.run("python", "integration-tests/demo.py", *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """For the borrowed GPU machine (no package registry; ci/gpu-machine.sh sets it up): the C++ tests with CUDA,
    then the three packages installed into the current Python without build isolation, their GPU-marked tests and
    benchmark smoke runs, and the integration tests. ``-- --full`` also runs each package's benchmarks/gpu_run.sh
    and the end-to-end runs at the large size (integration-tests/gpu_run.sh)."""
    build = Path(session.create_tmp()) / "shared-cuda-build"
    session.run("cmake", "-S", "shared-cuda", "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                external=True)
    session.run("cmake", "--build", str(build), external=True)
    session.run("ctest", "--test-dir", str(build), "--output-on-failure", external=True)
    session.run("python3", "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q",
                *(f"./{p}" for p in PACKAGES), external=True)
    for package, module in PACKAGES.items():
        # Exit code 5 is "no tests collected": a package may have no GPU tests yet.
        session.run("python3", "-m", "pytest", "-m", "gpu", f"{package}/tests", "-q", external=True,
                    success_codes=[0, 5])
        session.run("python3", "-m", "pytest", "-m", "gpu", "shared-cuda/python/tests", "-q",
                    env={"SHARED_CUDA_TEST_PACKAGE": module}, external=True)
    session.run("python3", "-m", "pytest", "integration-tests", "-q", external=True)
    if "--full" in session.posargs:
        for package in PACKAGES:
            script = ROOT / package / "benchmarks" / "gpu_run.sh"
            if script.exists():
                session.run("bash", str(script), external=True)
        session.run("bash", str(ROOT / "integration-tests" / "gpu_run.sh"), "--no-install", external=True)
