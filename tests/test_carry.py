"""The carry folder for a GPU machine without a registry (``vase.bench.carry``, ``scripts/gpu_carry.py``).

The fast tests check the requirement logic on synthetic wheels (no registry). The slow test runs the smoke's dry run
on a stand-in for the lent image: set ``VASE_CARRY_PYTHON`` to a Python with the image's torch 2.11,
huggingface-hub 1.33 and transformers 5.17 (docs/gpus.md says how to make one) and, optionally, ``VASE_CARRY_DIR``
to a built carry folder (else the test builds one, which needs the registry):

    VASE_CARRY_PYTHON=/tmp/t211/bin/python python -m pytest tests/test_carry.py -m slow
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

from vase.bench import REPO
from vase.bench.carry import (
    IMAGE,
    CarryError,
    implies,
    load,
    machine_problems,
    resolve,
    target_environment,
    wheel_info,
)

ENV = target_environment("3.11.7")
# transformers 5.17's own requirements (what the lent image is sure to have, in some version of these ranges)
IMAGE_REQUIRES = [
    "huggingface-hub<2.0,>=1.5.0", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1", "regex>=2025.10.22",
    "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0", "tqdm>=4.60",
]  # fmt: skip


def fake_wheel(tmp: Path, name: str, version: str, requires: list[str]) -> Path:
    """A wheel holding only its METADATA."""
    path = tmp / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", "\n".join(lines) + "\n")
    return path


def transformers_like(tmp: Path, version: str, hub: str) -> Path:
    return fake_wheel(tmp, "transformers", version, [
        f"huggingface-hub{hub}", "numpy>=1.17", "packaging>=20.0", "pyyaml>=5.1", "regex>=2025.10.22",
        "tokenizers<0.24.0,>=0.23.1", "typer", "safetensors>=0.8.0", "tqdm>=4.60",
        'torch>=2.6; extra == "torch"', 'accelerate>=1.1.0; extra == "torch"', 'pytest; extra == "testing"',
        'importlib-resources; python_version < "3.9"',
    ])  # fmt: skip


def carried(tmp: Path, transformers: Path) -> list:
    wheels = [
        transformers,
        fake_wheel(tmp, "hydra-core", "1.3.2", ["omegaconf (<2.4,>=2.2)", "antlr4-python3-runtime (==4.9.*)",
                                                 "packaging", 'importlib-resources ; python_version < "3.9"']),
        fake_wheel(tmp, "omegaconf", "2.3.0", ["antlr4-python3-runtime (==4.9.*)", "PyYAML (>=5.1.0)",
                                               'dataclasses ; python_version == "3.6"']),
        fake_wheel(tmp, "antlr4-python3-runtime", "4.9.3", ['typing; python_version < "3.5"']),
    ]  # fmt: skip
    return [wheel_info(w, ENV) for w in wheels]


def test_wheel_info_keeps_the_torch_floor_and_drops_other_extras_and_markers(tmp_path):
    w = wheel_info(transformers_like(tmp_path, "5.24.0", "<3.0,>=1.31.0"), ENV)
    assert (w.name, w.version) == ("transformers", "5.24.0")
    assert "torch>=2.6" in w.requires
    assert not any(r.startswith(("accelerate", "pytest", "importlib")) for r in w.requires)


def test_implies_is_conservative():
    assert implies(SpecifierSet(">=5.1"), SpecifierSet(">=5.1.0"))  # pyyaml: transformers' range vs omegaconf's
    assert implies(SpecifierSet(">=20.0"), SpecifierSet(""))
    assert implies(SpecifierSet("<0.24.0,>=0.23.1"), SpecifierSet(">=0.23.1,<0.24.0"))
    assert not implies(SpecifierSet(">=1.5"), SpecifierSet(">=2.4"))
    assert not implies(SpecifierSet(">=1.5"), SpecifierSet("<2"))  # an upper bound is not proven
    assert not implies(SpecifierSet(""), SpecifierSet(">=1"))


def test_the_carry_of_5_24_resolves_on_the_lent_image(tmp_path):
    wheels = carried(tmp_path, transformers_like(tmp_path, "5.24.0", "<3.0,>=1.31.0"))
    machine, missing = resolve(wheels, IMAGE, IMAGE_REQUIRES)
    assert missing == []
    assert "torch>=2.6" in machine and "huggingface-hub<3.0,>=1.31.0" in machine
    assert not any(m.startswith(("omegaconf", "antlr4")) for m in machine)  # carried, not asked of the machine


def test_transformers_5_25_is_refused_on_hub_1_33(tmp_path):
    """5.25 needs huggingface-hub >= 2.4: the image's 1.33 cannot import it (issue 36 item 5)."""
    wheels = carried(tmp_path, transformers_like(tmp_path, "5.25.0", "<3.0,>=2.4.0"))
    _, missing = resolve(wheels, IMAGE, IMAGE_REQUIRES)
    assert len(missing) == 1 and missing[0].startswith("huggingface-hub") and "image has 1.33.0" in missing[0]


def test_a_requirement_the_image_may_lack_is_missing(tmp_path):
    wheels = [wheel_info(fake_wheel(tmp_path, "hydra-core", "1.3.2", ["omegaconf (<2.4,>=2.2)"]), ENV)]
    _, missing = resolve(wheels, IMAGE, IMAGE_REQUIRES)
    assert [m.split(" ")[0] for m in missing] == ["omegaconf<2.4,>=2.2"]


def test_machine_problems_name_what_is_missing_or_too_old():
    manifest = {"machine_requires": ["torch>=2.6", "huggingface-hub<3.0,>=1.31.0", "numpy>=1.17"]}
    bad = machine_problems(manifest, {"torch": "2.11.0+cu130", "huggingface-hub": "1.29.0"})
    assert bad == ["huggingface-hub 1.29.0 (needs <3.0,>=1.31.0)", "numpy is not installed (needs >=1.17)"]
    assert machine_problems(manifest, {"torch": "2.11.0", "huggingface-hub": "1.33.0", "numpy": "2.1.0"}) == []


def test_load_names_the_missing_manifest_and_wheels(tmp_path):
    with pytest.raises(CarryError, match="no .*carry.json: build the carry folder"):
        load(tmp_path)
    (tmp_path / "carry.json").write_text('{"wheels": [{"file": "x-1-py3-none-any.whl"}]}')
    with pytest.raises(CarryError, match="lacks x-1-py3-none-any.whl"):
        load(tmp_path)


def test_smoke_refuses_a_carry_that_is_not_there(tmp_path):
    res = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "CARRY": str(tmp_path), "PY": sys.executable})  # fmt: skip
    assert res.returncode == 2 and "has no carry.json" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("VASE_CARRY_PYTHON"), reason="VASE_CARRY_PYTHON (the image's stand-in) unset")
def test_smoke_dry_run_from_the_carry_on_the_images_torch(tmp_path):
    """The smoke's dry run passes on the stand-in image (torch 2.11, hub 1.33, transformers 5.17, no hydra) with
    the carry folder: the machine check, the registry-free install and the import check, then every section."""
    py = os.environ["VASE_CARRY_PYTHON"]
    bare = subprocess.run([py, "-c", "import hydra"], capture_output=True)
    assert bare.returncode != 0, f"{py} has hydra: not a stand-in for the lent image"
    carry = tmp_path / "carry"
    if os.environ.get("VASE_CARRY_DIR"):
        shutil.copytree(Path(os.environ["VASE_CARRY_DIR"]), carry, ignore=shutil.ignore_patterns("site"))
    else:
        subprocess.run([sys.executable, "scripts/gpu_carry.py", "--out", str(carry)], cwd=REPO, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    res = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                         env={**env, "PY": py, "CARRY": str(carry), "OMP_NUM_THREADS": "1"})  # fmt: skip
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "transformers 5.24.0 (needs" in out and "\nPASS in " in out


def test_the_smoke_and_the_preflight_read_one_transformers_range():
    """The smoke's ``env`` check and the carry's preflight take the range from ``pyproject.toml`` the same way
    (:func:`vase.bench.carry.transformers_range`): one verdict, naming that range."""
    from importlib.metadata import version

    from vase.bench.carry import transformers_range
    from vase.bench.smoke import transformers_check

    want = transformers_range()
    assert str(want) and "transformers" not in str(want)
    ok, line = transformers_check()
    assert ok is want.contains(version("transformers"), prereleases=True)
    assert str(want) in line
