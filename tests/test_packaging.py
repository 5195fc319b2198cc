"""`pip install <checkout>` (not editable) into a fresh virtual environment, then the console scripts
from a directory outside the checkout: megafab-pretrain --help, megafab-preprocess --help, a
3-iteration --mock-data run, and `python -m megafab ...`.

No downloads: the new environment sees this one's site-packages (torch, numpy, ...) through a .pth
file, and pip builds megafab with --no-deps --no-build-isolation (setuptools from here too).
"""

import os
import shutil
import subprocess
import sys
import sysconfig

import pytest

from tests.helpers.flags import tiny_flags

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("megafab-pretrain", "megafab-preprocess", "megafab-merge", "megafab-convert", "megafab-generate",
           "megafab-estimate", "megafab-plot")
# What a wheel is built from: the project file, its readme and license, and the package.
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "megafab")


def run(cmd, cwd, env, timeout=300):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    source = tmp / "checkout"
    source.mkdir()
    for name in SOURCES:
        if os.path.isdir(os.path.join(ROOT, name)):
            shutil.copytree(os.path.join(ROOT, name), source / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(os.path.join(ROOT, name), source / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                           "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "host_packages.pth"), "w") as f:  # torch & co. from this environment
        paths = sysconfig.get_paths()
        f.write("\n".join(sorted({paths["purelib"], paths["platlib"]})) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
    run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         str(source)], cwd=tmp, env=env, timeout=600)
    work = tmp / "elsewhere"
    work.mkdir()
    return venv, site, env, work


@pytest.mark.slow
def test_the_wheel_installs_the_package_and_every_console_script(installed):
    venv, site, env, work = installed
    where = run([str(venv / "bin" / "python"), "-c", "import megafab; print(megafab.__file__, "
                 "megafab.__version__)"], cwd=work, env=env).stdout.split()
    assert where[0].startswith(site), where  # the installed copy, not the checkout
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = tomllib.load(f)["project"]["scripts"]
    assert sorted(declared) == sorted(SCRIPTS)
    assert all((venv / "bin" / name).exists() for name in SCRIPTS)
    dist_info = os.path.join(site, f"megafab-{where[1]}.dist-info")
    assert os.path.isfile(os.path.join(dist_info, "licenses", "LICENSE"))
    metadata = open(os.path.join(dist_info, "METADATA")).read()
    assert "License-Expression: Apache-2.0" in metadata and "Requires-Dist: torch<2.16,>=2.13" in metadata


@pytest.mark.slow
def test_console_scripts_help_from_outside_the_checkout(installed):
    _, _, env, work = installed
    pretrain = run(["megafab-pretrain", "--help"], cwd=work, env=env).stdout
    assert "usage: megafab-pretrain" in pretrain and "--tensor-model-parallel-size" in pretrain
    preprocess = run(["megafab-preprocess", "--help"], cwd=work, env=env).stdout
    assert "--output-prefix" in preprocess and "--tokenizer-type" in preprocess
    assert "--output-prefix" in run(["megafab-merge", "--help"], cwd=work, env=env).stdout
    assert "export-hf" in run(["megafab-convert", "--help"], cwd=work, env=env).stdout
    assert "--world-size" in run(["megafab-estimate", "--help"], cwd=work, env=env).stdout
    assert "--out" in run(["megafab-plot", "--help"], cwd=work, env=env).stdout
    assert "--prompt" in run(["megafab-generate", "--help"], cwd=work, env=env).stdout
    module = run(["python", "-m", "megafab", "merge", "--help"], cwd=work, env=env).stdout
    assert "--output-prefix" in module


@pytest.mark.slow
def test_a_three_iteration_mock_data_run_through_the_console_script(installed):
    _, _, env, work = installed
    out = run(["megafab-pretrain", *tiny_flags(num_layers=2), "--micro-batch-size", "2", "--train-iters", "3",
               "--lr", "1e-3", "--mock-data", "--vocab-size", "128", "--log-interval", "1",
               "--eval-iters", "0", "--num-workers", "0", "--save", "ckpt", "--save-interval", "3"],
              cwd=work, env=env).stdout
    assert [line.split("iteration")[1].split("|")[0].split()[0] for line in out.splitlines()
            if " iteration " in line and "lm loss:" in line] == ["1/", "2/", "3/"]
    assert (work / "ckpt" / "iter_0000003").is_dir() and (work / "ckpt" / "resolved_config.toml").is_file()
