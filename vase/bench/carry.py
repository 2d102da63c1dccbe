"""The carry folder: the wheels a GPU machine without a package registry needs to run the project's smoke
(``scripts/gpu_carry.py`` builds it on a connected machine; ``scripts/gpu_smoke.sh`` checks and uses it there).

A lent GPU image has its own torch and huggingface-hub (and an older transformers with its dependencies) but no
hydra, omegaconf or a transformers this project accepts, and no registry to fetch them. The carry folder holds
exactly what is missing, as wheels, with a manifest (``carry.json``) of what the carried wheels need *from the
machine* (torch, huggingface-hub, numpy, ...), so that the machine checks its own packages first and fails in one
line naming what is missing, before anything is installed:

* :data:`CARRY` — the carried releases: transformers 5.24.0 (the newest that imports with huggingface-hub 1.x: 5.25
  needs hub >= 2.4), hydra-core, omegaconf and antlr4-python3-runtime 4.9.3 (an sdist only on PyPI: its wheel is
  built with ``pip wheel``);
* :data:`IMAGE` — what the target image has, by default the lent image's torch 2.11.0, huggingface-hub 1.33.0 and
  transformers 5.17.0 (``--torch``, ``--hub``, ``--image-transformers``): a carried wheel's requirement is met by the
  image only if the image's version satisfies it (torch, hub) or the image's transformers already requires that
  package with a range that implies it (:func:`implies`); anything else is carried too;
* the folder is at most :data:`LIMIT_MIB` MiB (what a lent machine takes along).

On the machine (``scripts/gpu_smoke.sh`` does this when ``.carry/carry.json`` exists or ``CARRY=dir`` is set):
:func:`machine_problems` against the machine's own packages, then the wheels are installed without a registry
(``pip install --no-index --no-deps --target DIR/site``) and put first on ``PYTHONPATH``, then
:func:`import_problems` checks that each carried module imports at the carried version.

This module imports only the standard library and ``packaging`` (every transformers release requires it), so that it
runs on the bare machine.
"""

from __future__ import annotations

import email.parser
import hashlib
import json
import logging
import platform
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from importlib import import_module, metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

logger = logging.getLogger(__name__)

#: the carried releases (``name==version``)
CARRY = ("transformers==5.24.0", "hydra-core==1.3.2", "omegaconf==2.3.0", "antlr4-python3-runtime==4.9.3")
#: requirements taken from an extra (transformers' ``torch`` extra carries its torch floor, ``torch>=2.6``; the rest of
#: that extra, accelerate, is optional at import)
EXTRAS = {"transformers": {"torch": ("torch",)}}
#: the lent GPU image's own releases (the defaults of ``scripts/gpu_carry.py``'s --torch, --hub, --image-transformers)
IMAGE = {"torch": "2.11.0", "huggingface-hub": "1.33.0", "transformers": "5.17.0"}
#: the most a lent machine takes along, in MiB
LIMIT_MIB = 64.0
#: the module each carried distribution is imported as (the check after install)
MODULES = {"transformers": "transformers", "hydra-core": "hydra", "omegaconf": "omegaconf",
           "antlr4-python3-runtime": "antlr4", "tokenizers": "tokenizers", "safetensors": "safetensors"}  # fmt: skip
MANIFEST = "carry.json"
#: the modules the smoke imports beyond the standard library (checked by ``--preflight`` before it starts)
SMOKE_IMPORTS = ("torch", "numpy", "yaml", "huggingface_hub", "safetensors", "transformers", "omegaconf", "hydra")
REPO = Path(__file__).resolve().parents[2]


class CarryError(ValueError):
    """A carry folder that cannot work (one line: what and the fix)."""


@dataclass(frozen=True)
class Wheel:
    """One wheel's name, version and the requirements that apply on the target (markers evaluated, extras of
    :data:`EXTRAS` included)."""

    file: str
    name: str
    version: str
    requires: tuple[str, ...]


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker environment of the target: this machine's, with the target's Python version (Linux x86-64)."""
    env = dict(default_environment())
    env.update(python_version=".".join(python_version.split(".")[:2]), python_full_version=python_version,
               sys_platform="linux", platform_system="Linux", os_name="posix")  # fmt: skip
    return env


def wheel_info(path: Path, env: dict[str, str]) -> Wheel:
    """Name, version and applicable requirements of the wheel at ``path`` (read from its ``METADATA``)."""
    with zipfile.ZipFile(path) as z:
        meta = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        if len(meta) != 1:
            raise CarryError(f"{path}: not a wheel (no single *.dist-info/METADATA); delete it and rebuild the carry")
        msg = email.parser.Parser().parsestr(z.read(meta[0]).decode())
    name = canonicalize_name(msg["Name"])
    extras = EXTRAS.get(name, {})
    reqs = []
    for line in msg.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            reqs.append(req)
            continue
        for extra, names in extras.items():
            if canonicalize_name(req.name) in names and req.marker.evaluate({**env, "extra": extra}):
                reqs.append(req)
                break
    applicable = tuple(str(Requirement(f"{r.name}{r.specifier}")) for r in reqs)
    return Wheel(path.name, name, msg["Version"], applicable)


def lower_bound(spec: SpecifierSet) -> Version | None:
    """The smallest version ``spec`` names as a lower bound or pin (``>=``, ``>``, ``==``, ``~=``), or None."""
    bounds = [Version(s.version.replace(".*", "")) for s in spec if s.operator in (">=", ">", "==", "~=")]
    return max(bounds) if bounds else None


def implies(have: SpecifierSet, need: SpecifierSet) -> bool:
    """Whether every version ``have`` admits also satisfies ``need`` — decided conservatively: ``need`` is empty, or
    ``need`` only bounds from below (``>=``/``>``) and admits ``have``'s lower bound, or the two are equal. False
    means "not proven", never "incompatible"."""
    if not need or str(have) == str(need):
        return True
    if any(s.operator not in (">=", ">") for s in need):
        return False
    low = lower_bound(have)
    return low is not None and need.contains(low, prereleases=True)


def resolve(wheels: list[Wheel], image: dict[str, str], image_requires: list[str]) -> tuple[list[str], list[str]]:
    """What the carried ``wheels`` need from the machine, and what is unmet.

    ``image`` pins the image's own versions (torch, huggingface-hub, ...); ``image_requires`` are the requirements of
    the image's transformers (what the image is sure to have, in some version inside those ranges). Returns
    ``(machine, missing)``: ``machine`` the requirements the machine must meet itself (checked there by
    :func:`machine_problems`), ``missing`` the requirements neither the carry nor the image meets (``name spec (of
    wheel)``): carry those too."""
    carried = {w.name: w for w in wheels}
    pinned = {canonicalize_name(k): v for k, v in image.items()}
    has = {canonicalize_name(r.name): r.specifier for r in map(Requirement, image_requires)}
    machine: dict[str, SpecifierSet] = {}
    missing = []
    for w in wheels:
        for req in map(Requirement, w.requires):
            name = canonicalize_name(req.name)
            if name in carried:
                if not req.specifier.contains(carried[name].version, prereleases=True):
                    missing.append(f"{name}{req.specifier} (of {w.name} {w.version}; carried {carried[name].version})")
                continue
            if name in pinned:
                ok = req.specifier.contains(pinned[name], prereleases=True)
            else:
                ok = name in has and implies(has[name], req.specifier)
            if not ok:
                where = f"the image has {pinned[name]}" if name in pinned else "the image is not known to have it"
                missing.append(f"{name}{req.specifier} (of {w.name} {w.version}; {where})")
            machine[name] = machine.get(name, SpecifierSet()) & req.specifier
    return sorted(f"{n}{s}" for n, s in machine.items()), missing


def _pip(*args: str, cwd: Path | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if res.returncode:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise CarryError(f"`pip {' '.join(args)}` failed: {tail}")


def _wheel_name(path: Path) -> str:
    return canonicalize_name(path.name.split("-")[0])


def fetch(spec: str, dest: Path, python_version: str | None = None) -> Path:
    """Download the wheel of ``spec`` (``name==version``) into ``dest`` (for Python ``python_version`` when given), or
    build it from its sdist when PyPI has no wheel (antlr4-python3-runtime 4.9.x); the path of the wheel."""
    name = canonicalize_name(Requirement(spec).name)
    before = {p for p in dest.glob("*.whl") if _wheel_name(p) == name}
    for p in before:
        p.unlink()
    target = ["--python-version", python_version] if python_version else []
    try:
        _pip("download", "--no-deps", "--only-binary=:all:", *target, "-d", str(dest), spec)
    except CarryError:
        _pip("wheel", "--no-deps", "-w", str(dest), spec)
    got = sorted(p for p in dest.glob("*.whl") if _wheel_name(p) == name)
    if len(got) != 1:
        raise CarryError(f"pip gave {len(got)} wheels for {spec} in {dest}, not one")
    return got[0]


def folder_mib(path: Path) -> float:
    """Total size of the files under ``path`` in MiB."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def build(out: Path, image: dict[str, str], python_version: str, carry: tuple[str, ...] = CARRY,
          limit_mib: float = LIMIT_MIB) -> dict:  # fmt: skip
    """Build the carry folder at ``out`` (``out/wheels/*.whl`` and ``out/carry.json``) for a machine with the
    ``image``'s releases and Python ``python_version``; a :class:`CarryError` when a requirement stays unmet or the
    folder exceeds ``limit_mib``. Needs a registry (pip download). Returns the manifest."""
    if (out / "site").exists():
        raise CarryError(f"{out}/site exists (an installed carry): build into another folder, or delete {out}")
    env = target_environment(python_version)
    wheels_dir = out / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    for old in wheels_dir.glob("*.whl"):
        old.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        img = fetch(f"transformers=={image['transformers']}", Path(tmp))
        image_requires = list(wheel_info(img, env).requires)
    todo = list(carry)
    wheels: list[Wheel] = []
    for _ in range(10):  # the carried set grows by what neither the carry nor the image meets
        for spec in todo:
            wheels.append(wheel_info(fetch(spec, wheels_dir, python_version), env))
        machine, missing = resolve(wheels, image, image_requires)
        todo = []
        for line in missing:
            req = Requirement(line.split(" ")[0])
            name = canonicalize_name(req.name)
            if name in {w.name for w in wheels} or name in {canonicalize_name(k) for k in image}:
                raise CarryError(f"unmet requirement {line}; change the carried releases (vase/bench/carry.py: CARRY)")
            todo.append(f"{req.name}{req.specifier}")
        if not todo:
            break
    size = folder_mib(wheels_dir)
    if size > limit_mib:
        raise CarryError(f"{wheels_dir} holds {size:.1f} MiB, over the {limit_mib:g} MiB a lent machine takes")
    manifest = dict(
        image=image,
        python_version=python_version,
        machine_requires=machine,
        wheels=[dict(file=w.file, name=w.name, version=w.version, requires=list(w.requires),
                     sha256=hashlib.sha256((wheels_dir / w.file).read_bytes()).hexdigest()) for w in wheels],
        mib=round(size, 2),
        built_with=f"python {platform.python_version()}",
    )  # fmt: skip
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load(carry_dir: Path) -> dict:
    """The manifest of the carry folder ``carry_dir`` (a one-line error when there is none or a wheel is missing)."""
    path = carry_dir / MANIFEST
    if not path.is_file():
        raise CarryError(f"no {path}: build the carry folder with `python scripts/gpu_carry.py --out {carry_dir}`")
    manifest = json.loads(path.read_text())
    gone = [w["file"] for w in manifest["wheels"] if not (carry_dir / "wheels" / w["file"]).is_file()]
    if gone:
        raise CarryError(f"{carry_dir}/wheels lacks {', '.join(gone)}: copy the whole folder or rebuild it")
    return manifest


def machine_problems(manifest: dict, installed: dict[str, str | None] | None = None) -> list[str]:
    """What the machine lacks of ``manifest['machine_requires']`` (``name: have X, needs spec``); ``installed`` maps
    names to versions (None: not installed), by default the machine's own distributions."""
    out = []
    for line in manifest["machine_requires"]:
        req = Requirement(line)
        if installed is not None:
            have = installed.get(canonicalize_name(req.name))
        else:
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                have = None
        if have is None:
            out.append(f"{req.name} is not installed (needs {req.specifier or 'any version'})")
        elif not req.specifier.contains(have, prereleases=True):
            out.append(f"{req.name} {have} (needs {req.specifier})")
    return out


def import_problems(manifest: dict) -> list[str]:
    """The carried modules that do not import, or import at another version than carried (the machine's own copy
    shadowing the carry: ``PYTHONPATH`` not set to the installed carry)."""
    out = []
    for w in manifest["wheels"]:
        module = MODULES.get(w["name"], w["name"].replace("-", "_"))
        try:
            import_module(module)
            have = metadata.version(w["name"])
        except Exception as e:  # noqa: BLE001 - any import failure is the answer
            out.append(f"{module}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            continue
        if have != w["version"]:
            out.append(f"{w['name']} {have} imports, not the carried {w['version']} (is PYTHONPATH the carry's site?)")
    return out


def transformers_range() -> SpecifierSet:
    """The transformers releases ``pyproject.toml`` accepts."""
    import re

    pin = re.search(r'"transformers([^"]*)"', (REPO / "pyproject.toml").read_text())
    return SpecifierSet(pin.group(1)) if pin else SpecifierSet()


def smoke_problems() -> list[str]:
    """What keeps the smoke from starting here: a module of :data:`SMOKE_IMPORTS` that does not import, or a
    transformers outside ``pyproject.toml``'s range."""
    out = []
    for module in SMOKE_IMPORTS:
        try:
            import_module(module)
        except Exception as e:  # noqa: BLE001 - any import failure is the answer
            out.append(f"{module} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
    if not any(o.startswith("transformers ") for o in out):
        have, want = metadata.version("transformers"), transformers_range()
        if not want.contains(have, prereleases=True):
            out.append(f"transformers {have} (the project needs {want})")
    return out


def main(argv: list[str] | None = None) -> int:
    """``scripts/gpu_carry.py``: build the carry folder (default), or, on the machine, ``--check`` its packages
    against the manifest and ``--verify`` that the installed carry imports."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".carry"), help="the carry folder (default .carry, git-ignored)")
    ap.add_argument("--torch", default=IMAGE["torch"], help="the target machine's torch (default %(default)s)")
    ap.add_argument("--hub", default=IMAGE["huggingface-hub"], help="its huggingface-hub (default %(default)s)")
    ap.add_argument("--image-transformers", default=IMAGE["transformers"],
                    help="the transformers its image ships (its requirements are what the image is sure to have; "
                    "default %(default)s)")  # fmt: skip
    ap.add_argument("--python-version", default=platform.python_version(),
                    help="the target's Python (default this one's, %(default)s)")  # fmt: skip
    ap.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="size limit (default %(default)s MiB)")
    ap.add_argument("--check", action="store_true", help="on the machine: its own packages against the manifest")
    ap.add_argument("--verify", action="store_true", help="on the machine: carried modules import as carried")
    ap.add_argument("--preflight", action="store_true", help="what the smoke imports, imports here (no carry needed)")
    args = ap.parse_args(argv)
    if args.preflight:
        bad = smoke_problems()
        if bad:
            raise CarryError(f"this Python ({sys.executable}) cannot run the smoke: {'; '.join(bad)}; install the "
                             "project (docs/gpus.md), or without a registry build a carry folder with "
                             "scripts/gpu_carry.py on a connected machine and copy it here as .carry/")  # fmt: skip
        print(f"preflight: {', '.join(SMOKE_IMPORTS)} import; transformers {metadata.version('transformers')}")
        return 0
    if args.check or args.verify:
        manifest = load(args.out)
        if args.check:
            bad = machine_problems(manifest)
            if bad:
                built = ", ".join(f"{k} {v}" for k, v in manifest["image"].items())
                raise CarryError(f"this machine does not meet the carry {args.out} (built for {built}): "
                                 f"{'; '.join(bad)}; rebuild it with scripts/gpu_carry.py --torch/--hub set to "
                                 "this machine's versions")  # fmt: skip
        if args.verify:
            bad = import_problems(manifest)
            if bad:
                raise CarryError(f"the carry {args.out} does not import: {'; '.join(bad)}")
        if args.check:
            print(f"carry {args.out}: this machine meets {', '.join(manifest['machine_requires'])}")
        if args.verify:
            print(f"carry {args.out}: imports {', '.join(w['name'] + ' ' + w['version'] for w in manifest['wheels'])}")
        return 0
    image = {"torch": args.torch, "huggingface-hub": args.hub, "transformers": args.image_transformers}
    m = build(args.out, image, args.python_version, limit_mib=args.limit_mib)
    print(f"{args.out}: {len(m['wheels'])} wheels, {m['mib']:.1f} MiB (limit {args.limit_mib:g}) for torch "
          f"{args.torch}, huggingface-hub {args.hub}, Python {args.python_version}:")  # fmt: skip
    for w in m["wheels"]:
        print(f"  {w['file']}")
    print(f"the machine must have: {', '.join(m['machine_requires'])}")
    print(f"copy {args.out}/ into the checkout on the GPU machine; scripts/gpu_smoke.sh installs and uses it")
    return 0
