"""What the device check (.ci/gpu) runs, and the wheels the device host needs for it.

The device host has no network: what it lacks of the project's dependencies travels as wheels. The
list comes from the project's own dependency specification (pyproject.toml's build requirements and
dependencies, closed over their requirements as installed here), less what the host's image holds
(.ci/device-packages.txt), each pinned to the version installed here, the one the tests ran with.

    python .ci/device_env.py wheels          # the distributions to carry, NAME==VERSION per line
    python .ci/device_env.py fetch DIR       # download them for CPython 3.12 x86-64 into DIR, and
                                             # kt-kernel's AMX build into DIR/kt-kernel/ (KT_KERNEL)
    python .ci/device_env.py kt-kernel SITE DIR  # the files of KT_KERNEL_FILES from an installed
                                             # kt-kernel (SITE) into DIR (tests check the selection)
    python .ci/device_env.py tests           # the test files the device check runs
    python .ci/device_env.py check [--without NAME ...]
        # import everything the device check imports, with only the host's and the carried
        # distributions visible to the project's code; exits 1 naming each import not covered

Standard library only: the device host runs `tests` with its own Python.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.metadata
import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST_PYTHON = "3.12"

# The device check's tests (.ci/gpu runs them with -k "amx and not emu or ...").
TESTS = [
    f"tests/test_{name}.py"
    for name in (
        "kernels activation vector_ops sft fp8_checkpoint int4_checkpoints mxfp4_checkpoints "
        "nvfp4_checkpoints moe_accuracy validation amx_model layer_gpu triton_kernels heat_placement"
    ).split()
]
# Its scripts, and the package modules its command-line steps reach (doctor, bench).
SCRIPTS = ["bench/bench_amx_kernels.py", "bench/bench_decode_step.py", "bench/bench_prefill.py"]
MODULES = ["kt_sglang.cli.main", "kt_sglang.cli.doctor", "kt_sglang.cli.bench", "kt_sglang.engine.pools"]


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def host_packages() -> set[str]:
    lines = (ROOT / ".ci" / "device-packages.txt").read_text().splitlines()
    return {normalize(line) for line in lines if line.strip() and not line.startswith("#")}


def _requirement_name(spec: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[(]", spec.strip(), maxsplit=1)[0])


def _applies(spec: str) -> bool:
    """A requirement line applies unless its marker asks for an extra or another platform."""
    if ";" not in spec:
        return True
    marker = spec.split(";", 1)[1]
    if "extra" in marker:
        return False
    env = {"python_version": HOST_PYTHON, "sys_platform": "linux", "platform_system": "Linux",
           "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
           "platform_python_implementation": "CPython"}  # fmt: skip
    try:  # packaging is present wherever pip is
        from packaging.markers import Marker

        return Marker(marker).evaluate(env)
    except ImportError:
        return True


def project_requirements() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)
    return project["build-system"]["requires"] + project["project"]["dependencies"]


def carried_wheels() -> dict[str, str]:
    """{distribution: installed version} of everything the project needs that the host lacks."""
    have = host_packages()
    wanted: dict[str, str] = {}
    todo = [_requirement_name(r) for r in project_requirements() if _applies(r)]
    while todo:
        name = todo.pop()
        if name in have or name in wanted:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(
                f"{name} is a requirement of the device path but is not installed here: run `bash .ci/run` "
                "first (this script reads the versions the tests ran with)"
            ) from None
        wanted[name] = dist.version
        todo += [_requirement_name(r) for r in dist.requires or [] if _applies(r)]
    return dict(sorted(wanted.items()))


# kt-kernel, run side by side with ours on the device host (`kt-sglang bench --kt-kernel-python`):
# of its wheel (~100 MB: CUDA kernels, NCCL) only its Python files, its AMX extension and the
# libraries that extension links travel (~12 MB).
KT_KERNEL = "kt-kernel==0.7.2"
KT_KERNEL_FILES = re.compile(
    r"^(kt_kernel/(?!cli/).*\.py|kt_kernel/_kt_kernel_ext_amx\..*\.so|kt_kernel\.libs/.*)$"
)


def select_kt_kernel(names: list[str]) -> list[str]:
    return [n for n in names if KT_KERNEL_FILES.match(n)]


def copy_kt_kernel(site: Path, target: Path) -> None:
    """KT_KERNEL_FILES of an installed kt-kernel into ``target``."""
    names = [str(p.relative_to(site)) for p in site.rglob("*") if p.is_file()]
    for name in select_kt_kernel(names):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes((site / name).read_bytes())


def fetch_kt_kernel(target: Path) -> None:
    """KT_KERNEL_FILES of kt-kernel's CPython 3.12 wheel into ``target``/site."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", HOST_PYTHON, "--implementation", "cp", "--platform",
               "manylinux_2_35_x86_64", "-d", scratch, KT_KERNEL]  # fmt: skip
        subprocess.run(cmd, check=True)
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in select_kt_kernel(z.namelist()):
                z.extract(name, target / "site")


def fetch(target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={version}" for name, version in carried_wheels().items()]
    platforms = ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", HOST_PYTHON, "--implementation", "cp", "-d", str(target)]  # fmt: skip
    for p in platforms:
        cmd += ["--platform", p]
    subprocess.run(cmd + pins, check=True)
    fetch_kt_kernel(target / "kt-kernel")


class _Fence(importlib.abc.MetaPathFinder):
    """Refuses the project's imports of distributions the device host would not have."""

    def __init__(self, allowed: set[str], project_dirs: list[Path]) -> None:
        self.allowed = allowed
        self.project_dirs = [str(d) for d in project_dirs]
        self.owners = importlib.metadata.packages_distributions()
        self.missing: dict[str, str] = {}

    def _from_project(self) -> str | None:
        """The project file that asked for the import, if the nearest non-import frame is one."""
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not name.startswith("<frozen importlib") and "importlib" not in Path(name).parts:
                return name if any(name.startswith(d) for d in self.project_dirs) else None
            frame = frame.f_back
        return None

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if path is not None or top in sys.stdlib_module_names or top == "kt_sglang":
            return None
        dists = {normalize(d) for d in self.owners.get(top, [])}
        if not dists or dists & self.allowed:
            return None  # a local module (tests/, bench/), or one the host will have
        importer = self._from_project()
        if importer is None:
            return None  # a third-party package's own import: the host's install is consistent
        self.missing[top] = f"{top} (from {'/'.join(sorted(dists))}), imported by {importer}"
        raise ModuleNotFoundError(f"No module named {top!r} on the device host", name=top)


def check(without: list[str]) -> int:
    allowed = (host_packages() | set(carried_wheels())) - {normalize(n) for n in without}
    # Found, not imported: the fence must be in place before anything of the project runs.
    package_dir = Path(importlib.util.find_spec("kt_sglang").origin).resolve().parent
    fence = _Fence(allowed, [package_dir, ROOT / "tests", ROOT / "bench"])
    sys.meta_path.insert(0, fence)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]
    failures = []
    targets = [(m, None) for m in MODULES] + [(Path(p).stem, ROOT / p) for p in TESTS + SCRIPTS]
    for name, path in targets:
        try:
            if path is None:
                importlib.import_module(name)
            else:  # as a module of another name: a script's main block does not run
                spec = importlib.util.spec_from_file_location(f"_device_check_{name}", path)
                module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
        except ModuleNotFoundError as exc:
            failures.append(f"{path or name}: {exc}")
    for line in failures:
        print(f"not importable on the device host: {line}")
    for line in fence.missing.values():
        print(f"  {line}")
    if not failures:
        print(f"device imports covered: {len(targets)} modules, scripts and test files")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("wheels")
    sub.add_parser("fetch").add_argument("dir", type=Path)
    kt = sub.add_parser("kt-kernel")
    kt.add_argument("site", type=Path)
    kt.add_argument("dir", type=Path)
    sub.add_parser("tests")
    sub.add_parser("check").add_argument("--without", nargs="*", default=[], metavar="NAME")
    args = parser.parse_args()
    if args.command == "wheels":
        print("\n".join(f"{n}=={v}" for n, v in carried_wheels().items()))
    elif args.command == "fetch":
        fetch(args.dir)
    elif args.command == "kt-kernel":
        copy_kt_kernel(args.site, args.dir)
    elif args.command == "tests":
        print(" ".join(TESTS))
    else:
        return check(args.without)
    return 0


if __name__ == "__main__":
    sys.exit(main())
