"""Every program's command line on absl: ``--helpfull`` lists its flags, a
``--flagfile`` sets them, the defaults are the ones the earlier argparse
command lines had, and a bad flag or a positional argument exits with
status 2.

The programs run as child processes: absl keeps one flag registry per
process, and several programs define a flag of the same name (``--seed``,
``--steps``, ``--points``), so no two are imported into one process.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from absl import flags

#: Each program's flags at their defaults (as its argparse parser had them).
#: A flag added to a program can be added here and in FLAGFILES.
DEFAULTS = {
    "examples.demo": {
        "rules": None,
        "points": None,
        "steps": None,
        "save": None,
        "data": None,
        "layout": "semantickitti",
        "out-dir": None,
        "results": None,
        "seed": 0,
        "quick": False,
        "features": "occupancy,height",
    },
    "examples.segment": {
        "model": None,
        "points": None,
        "out": None,
        "labels-out": None,
        "label-map": None,
        "ply-out": None,
        "picture": None,
    },
    "examples.train_distributed": {
        "steps": 10,
        "warmup": 2,
        "global-batch": 4,
        "scans": 16,
        "voxel": 0.2,
        "widths": "16,32,48",
        "small-scene": False,
        "sync-bn": False,
        "lr": 0.05,
        "seed": 0,
        "threads": None,
        "timeout": 120.0,
        "json": False,
    },
    "benchmarks.sparse_unet": {
        "quick": False,
        "rounds": 3,
        "no-forward": False,
        "models": "MinkUNet,SPVCNN",
        "no-retain": False,
        "cache-limit-mb": None,
        "threads": None,
        "sweep-voxels": 400_000,
    },
    "benchmarks.sparse_layers": {"points": 100_000},
    "benchmarks.distributed": {
        "steps": 5,
        "global-batch": 2,
        "voxel": 0.2,
        "widths": "16,32,48",
        "timeout": 300.0,
        "allreduce-worker": False,
    },
}

#: A flag file per program that sets every flag away from its default.
FLAGFILES = {
    "examples.demo": {
        "rules": "rules.json",
        "points": "cloud.ply",
        "steps": 3,
        "save": "model.safetensors",
        "data": "scans",
        "layout": "folder",
        "out-dir": "pictures",
        "results": "scores.inc",
        "seed": 7,
        "quick": True,
        "features": "occupancy,height,intensity",
    },
    "examples.segment": {
        "model": "m.safetensors",
        "points": "scan.bin",
        "out": "labels.npy",
        "labels-out": "kitti",
        "label-map": "map.json",
        "ply-out": "scan.ply",
        "picture": "scan.png",
    },
    "examples.train_distributed": {
        "steps": 3,
        "warmup": 0,
        "global-batch": 2,
        "scans": 4,
        "voxel": 0.5,
        "widths": "8,16",
        "small-scene": True,
        "sync-bn": True,
        "lr": 0.1,
        "seed": 3,
        "threads": 1,
        "timeout": 30.0,
        "json": True,
    },
    "benchmarks.sparse_unet": {
        "quick": True,
        "rounds": 1,
        "no-forward": True,
        "models": "SPVCNN",
        "no-retain": True,
        "cache-limit-mb": 64,
        "threads": "1,2,all",
        "sweep-voxels": 50_000,
    },
    "benchmarks.sparse_layers": {"points": 5000},
    "benchmarks.distributed": {
        "steps": 2,
        "global-batch": 4,
        "voxel": 0.5,
        "widths": "8,16",
        "timeout": 60.0,
        "allreduce-worker": True,
    },
}

#: Imports a program, parses the command lines given as JSON lists and prints
#: the values of the flags the program defines, one JSON object per line.
FLAG_VALUES = """
import importlib, json, sys
from absl import flags
from examples import cli
module = importlib.import_module(sys.argv[1])
for argv in json.loads(sys.argv[2]):
    cli.parse(argv)
    print(json.dumps({f.name: f.value for f in flags.FLAGS.get_key_flags_for_module(module)}))
"""

REQUIRED = {"examples.segment": ["--model=m", "--points=p", "--out=o.npy"]}


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))


def _script(module: str) -> str:
    return importlib.util.find_spec(module).origin


def _python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _flag_line(name: str, value: object) -> str:
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no{name}"
    return f"--{name}={value}"


@pytest.mark.parametrize("module", sorted(DEFAULTS))
def test_defaults_and_a_flagfile(module, tmp_path):
    """With no flags every flag has its earlier default; a flag file sets each one."""
    flagfile = tmp_path / "run.flags"
    flagfile.write_text("".join(_flag_line(k, v) + "\n" for k, v in FLAGFILES[module].items()))
    runs = [REQUIRED.get(module, []), [f"--flagfile={flagfile}"]]
    proc = _python("-c", FLAG_VALUES, module, json.dumps(runs))
    assert proc.returncode == 0, proc.stderr
    defaults, from_file = (json.loads(line) for line in proc.stdout.splitlines())
    expect = dict(DEFAULTS[module])
    for arg in REQUIRED.get(module, []):
        name, value = arg[2:].split("=")
        expect[name] = value
    # The flags listed here (a program may have more: flags added later keep
    # this test passing until they are listed too).
    assert {name: defaults.get(name, "missing") for name in expect} == expect
    assert {name: from_file[name] for name in FLAGFILES[module]} == FLAGFILES[module]


@pytest.mark.parametrize("module", sorted(DEFAULTS))
def test_helpfull_lists_the_flags(module):
    proc = _python(_script(module), "--helpfull")
    # absl's help flags exit with status 1 after printing the help on stdout.
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "--flagfile" in proc.stdout and "--helpfull" in proc.stdout
    for name in DEFAULTS[module]:
        assert f"--{name}:" in proc.stdout or f"--[no]{name}:" in proc.stdout, name


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("examples.demo", ["--steps=0"], "--steps=0"),
        ("examples.demo", ["--save=model.txt"], "--save needs a .safetensors path"),
        ("examples.demo", ["--layout=kitti"], "--layout"),
        ("examples.demo", ["--quick", "extra"], "unexpected arguments ['extra']"),
        ("examples.segment", ["--points=p", "--out=o.npy"], "--model"),
        ("examples.segment", ["--model=m", "--points=p", "--out=o.txt"], "must be a .npy path"),
        ("examples.segment", ["--model=m", "--points=p"], "no output: give at least one of --out"),
        ("examples.segment", ["--model=m", "--points=p", "--ply-out=s.ply", "--label-map=m.json"],
         "--label-map sets the ids of the --labels-out file: give --labels-out too"),
        ("benchmarks.sparse_unet", ["--models=MinkUNet,PointNet"], "choose from MinkUNet"),
        ("benchmarks.sparse_unet", ["--threads=1,two"], "--threads: comma-separated integers"),
        ("benchmarks.sparse_unet", ["--threads=0,2"], "--threads: comma-separated integers"),
        ("benchmarks.sparse_unet", ["--sweep-voxels=0"], "--sweep-voxels"),
    ],
)
def test_bad_flags_exit_with_status_2(module, args, message):
    proc = _python(_script(module), *args)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_flagfile_run_of_segment(tmp_path):
    """The command line through app.run: flags from the file reach main,
    which reports the damaged model file by name."""
    model = tmp_path / "broken.safetensors"
    model.write_bytes(b"\0" * 64)
    flagfile = tmp_path / "segment.flags"
    flagfile.write_text(
        f"--model={model}\n--points={tmp_path / 'scan.npy'}\n--out={tmp_path / 'labels.npy'}\n"
    )
    proc = _python(_script("examples.segment"), f"--flagfile={flagfile}")
    assert proc.returncode == 2 and "broken.safetensors" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_flagfile_run_of_train_distributed(tmp_path):
    flagfile = tmp_path / "train.flags"
    flagfile.write_text(
        "--small-scene\n--voxel=0.5\n--widths=8,16\n--steps=2\n--warmup=0\n--scans=2\n"
        "--global-batch=1\n--threads=1\n--json\n"
    )
    proc = _python(_script("examples.train_distributed"), f"--flagfile={flagfile}")
    assert proc.returncode == 0, proc.stderr
    assert "step 2/2  loss" in proc.stdout
    summary = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("JSON "))[5:])
    assert summary["ranks"] == 1 and summary["threads"] == 1


def test_shared_modules_define_no_flags():
    """Modules that several programs import define no flag (absl refuses a
    second definition of a name from another module)."""
    for name in ("examples.cli", "examples.pictures", "examples.sparse_unet", "benchmarks.timing"):
        importlib.import_module(name)
        assert name not in flags.FLAGS.flags_by_module_dict(), name
