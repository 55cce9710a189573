"""Pack what the GPU checks need beyond a GPU machine with CUDA torch, into one archive.

Run it, on a machine with the registry, with an interpreter where vLLM 0.33.0 and its
dependencies are installed (``nox -s vllm --install-only`` makes one: ``.nox/vllm/bin/python``)::

    .nox/vllm/bin/python tools/pack_gpu_run.py --out dist

It writes ``dist/hybridkv-gpu-run.tar.gz``, one folder ``hybridkv-gpu-run/`` holding:

- the project: every file git tracks in this checkout, plus the new ones it does not ignore
  (spec/, hybridkv/, tests/, tools/, pyproject.toml...), at the folder's top;
- ``site/``: vLLM 0.33's Python sources WITHOUT its compiled kernels (every ``*.so`` of vllm
  is left out: the worker test plans on vLLM's CPU platform and never calls them), and the
  packages importing vLLM's scheduler needs (tests/vllm/requirements-vllm.txt), pytest,
  hypothesis, pytest-cov and coverage, each copied from this interpreter's site-packages with
  its ``.dist-info``;
- ``gpu-run.json``: the Python version and platform the packed compiled packages (pydantic_core,
  msgspec...) were built for, each package's version, and the commands to run on the target.

A GPU machine whose Python differs from this interpreter's (the compiled packages are built per
minor version) gets its own: ``--python 3.12`` fetches every packed dependency, at the version
installed here, as a wheel for CPython 3.12 on manylinux x86-64 from the registry, and unpacks it
into ``site/`` (``pip install --target`` for that Python); vLLM's sources are copied as above,
since without their kernels they are the same for every Python.

Left out because CUDA torch brings its own (and a second copy could shadow it): torch and what
torch itself requires (filelock, fsspec, Jinja2, MarkupSafe, mpmath, networkx, sympy,
typing_extensions), and torchvision (a build tied to one torch). ``--no-deps`` packs vLLM alone,
for a target that already has its dependencies.

Then, on the GPU machine (the same Python minor version; no registry)::

    tar -xzf hybridkv-gpu-run.tar.gz
    cd hybridkv-gpu-run
    PYTHONPATH="$PWD:$PWD/site" python tools/gpu_checks.py

Exit codes: 0 packed; 2 nothing packed (the line on stderr says why: vLLM 0.33.0 missing from
this interpreter, a package of the list missing, not a git checkout).
"""

from __future__ import annotations

import argparse
import io
import json
import re
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent
REQUIREMENTS = ROOT / "tests" / "vllm" / "requirements-vllm.txt"
TOP = "hybridkv-gpu-run"
ARCHIVE = f"{TOP}.tar.gz"
VLLM_VERSION = "0.33.0"
# CUDA torch installs these itself (torch's own requirements); torchvision is built per torch.
TORCH_BRINGS = {
    "filelock",
    "fsspec",
    "jinja2",
    "markupsafe",
    "mpmath",
    "networkx",
    "sympy",
    "torch",
    "torchvision",
    "typing-extensions",
}
# What running tests/gpu takes besides vLLM: the test runner, its plugins' needs, hypothesis.
# pytest-cov and coverage print the CUDA files' own coverage figure (tools/gpu_checks.py).
TEST_RUNNER = [
    "pytest",
    "pluggy",
    "iniconfig",
    "hypothesis",
    "sortedcontainers",
    "pytest-cov",
    "coverage",
]
# The platforms a wheel fetched for another Python may be built for (--python): manylinux
# x86-64, the GPU machines' platform, from the oldest glibc tag to a recent one.
MANYLINUX = (
    "manylinux1_x86_64",
    "manylinux2014_x86_64",
    *(f"manylinux_2_{n}_x86_64" for n in range(17, 40)),
)
COMMANDS = [
    f"tar -xzf {ARCHIVE}",
    f"cd {TOP}",
    'PYTHONPATH="$PWD:$PWD/site" python tools/gpu_checks.py',
]


class PackError(Exception):
    """Nothing can be packed; the message says what is missing and how to get it."""


def normalize(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def packed_names(with_deps: bool) -> list[str]:
    """The distributions to pack: vllm, and (``with_deps``) what importing it and the tests need."""
    names = ["vllm"]
    if with_deps:
        for line in REQUIREMENTS.read_text(encoding="utf-8").splitlines():
            requirement = line.split("#", 1)[0].strip()
            if requirement:
                names.append(re.split(r"[<>=!~ ;\[]", requirement, maxsplit=1)[0])
        names += TEST_RUNNER
    chosen: dict[str, str] = {}
    for name in names:
        if normalize(name) not in TORCH_BRINGS:
            chosen.setdefault(normalize(name), name)
    return list(chosen.values())


def installed(name: str) -> metadata.Distribution:
    """``name``'s distribution in this interpreter (vllm: the version the checks need)."""
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        raise PackError(
            f"{name} is not installed in {sys.executable}: run this script with the interpreter "
            "of `nox -s vllm --install-only` (.nox/vllm/bin/python)"
        ) from None
    if normalize(name) == "vllm" and dist.version != VLLM_VERSION:
        raise PackError(f"this interpreter has vllm {dist.version}; the checks need {VLLM_VERSION}")
    return dist


def distribution_files(name: str) -> Iterator[tuple[Path, str]]:
    """(file on disk, path inside site/) for every file of ``name`` in this interpreter.

    Left out: byte code, files installed outside site-packages (console scripts) and, for vllm,
    the compiled kernels.
    """
    dist = installed(name)
    for relative in dist.files or ():
        parts = PurePosixPath(str(relative)).parts
        if ".." in parts or "__pycache__" in parts or str(relative).endswith(".pyc"):
            continue
        if normalize(name) == "vllm" and str(relative).endswith(".so"):
            continue
        path = Path(str(dist.locate_file(relative)))
        if path.is_file():
            yield path, str(PurePosixPath(*parts))


def project_files() -> list[str]:
    """The checkout's files: tracked, and new ones git does not ignore."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise PackError(f"{ROOT} is not a git checkout with git on PATH ({err})") from None
    return sorted(p for p in listed.decode().split("\0") if p and (ROOT / p).is_file())


def this_python() -> str:
    """This interpreter's minor version, as ``--python`` takes it (``3.11``)."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def fetch_for(python: str, packages: dict[str, str], site: Path) -> None:
    """Install ``packages`` (name -> version) into ``site`` as CPython ``python`` wheels for
    manylinux x86-64, fetched from the registry, without their dependencies (each one packed is
    named here)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-compile",
        "--only-binary=:all:",
        "--target",
        str(site),
        "--python-version",
        python,
        "--implementation",
        "cp",
        *(f"--platform={tag}" for tag in MANYLINUX),
        *(f"{name}=={version}" for name, version in packages.items()),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise PackError(
            f"pip could not fetch the wheels for Python {python} "
            f"({said[-1] if said else f'exit {done.returncode}'}): this needs the registry, "
            "and every package at the version installed here built for that Python"
        )


def site_files(site: Path) -> Iterator[tuple[Path, str]]:
    """(file, path inside site/) for what ``fetch_for`` installed, without byte code or scripts."""
    for path in sorted(site.rglob("*")):
        inside = path.relative_to(site)
        if not path.is_file() or inside.parts[0] == "bin" or "__pycache__" in inside.parts:
            continue
        yield path, inside.as_posix()


def manifest(packages: dict[str, str], python: str) -> dict[str, object]:
    """What the target needs to know: the Python the compiled packages are for, and the steps."""
    return {
        "python": python,
        "platform": sysconfig.get_platform() if python == this_python() else "manylinux x86_64",
        "packages": packages,
        "vllm_without": "*.so (compiled kernels)",
        "commands": COMMANDS,
    }


def pack(out: Path, *, with_deps: bool = True, level: int = 6, python: str | None = None) -> Path:
    """Write the archive into ``out`` and return its path (module docstring: what is in it).

    ``python``: the target's minor version; another than this interpreter's fetches the
    dependencies for it (``fetch_for``)."""
    python = python or this_python()
    packages: dict[str, str] = {}
    files: list[tuple[Path, str]] = [(ROOT / p, p) for p in project_files()]
    fetched: dict[str, str] = {}
    for name in packed_names(with_deps):
        if python != this_python() and normalize(name) != "vllm":
            fetched[name] = installed(name).version
        else:
            files += [(path, f"site/{inside}") for path, inside in distribution_files(name)]
        packages[name] = metadata.version(name)
    out.mkdir(parents=True, exist_ok=True)
    target = out / ARCHIVE
    with tempfile.TemporaryDirectory() as scratch:
        if fetched:
            fetch_for(python, fetched, Path(scratch))
            files += [(path, f"site/{inside}") for path, inside in site_files(Path(scratch))]
        write_archive(target, files, manifest(packages, python), level)
    return target


def write_archive(
    target: Path, files: list[tuple[Path, str]], about: dict[str, object], level: int
) -> None:
    """The tar.gz: every file under the one top folder, and ``gpu-run.json``."""
    with tarfile.open(target, "w:gz", compresslevel=level) as archive:
        for path, inside in files:
            archive.add(path, arcname=f"{TOP}/{inside}", recursive=False)
        text = json.dumps(about, indent=2).encode()
        info = tarfile.TarInfo(f"{TOP}/gpu-run.json")
        info.size = len(text)
        archive.addfile(info, io.BytesIO(text))


def main(argv: list[str] | None = None) -> int:
    """Parse the flags, pack, print the archive and the commands; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist", help="folder for the archive")
    parser.add_argument(
        "--no-deps", action="store_true", help="pack vLLM alone (the target has its dependencies)"
    )
    parser.add_argument("--level", type=int, default=6, choices=range(1, 10), help="gzip level")
    parser.add_argument(
        "--python",
        metavar="X.Y",
        help="the GPU machine's Python, when it is not this one's: its dependencies are fetched "
        "for it from the registry (default: this interpreter's)",
    )
    args = parser.parse_args(argv)
    if args.python is not None and not re.fullmatch(r"3\.\d{1,2}", args.python):
        print(
            f"pack_gpu_run: --python {args.python!r} is not a Python minor version: "
            "give it as 3.12",
            file=sys.stderr,
        )
        return 2
    try:
        target = pack(args.out, with_deps=not args.no_deps, level=args.level, python=args.python)
    except PackError as err:
        print(f"pack_gpu_run: {err}", file=sys.stderr)
        return 2
    size = target.stat().st_size / 2**20
    print(f"packed {target} ({size:.0f} MiB); on the GPU machine, beside the archive:")
    for command in COMMANDS:
        print(f"  {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
