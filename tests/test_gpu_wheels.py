"""scripts/gpu_wheels.sh: the wheels gpu_check.sh carries to the GPU machine (no network, no
KvikIO there) fit in 16 MiB, and installed as gpu_check.sh installs them (``--no-index
--no-deps --target``) give a working ``import kvikio`` on Python 3.12, the machine's Python,
beside what that machine has of its own (numpy, nvidia-cufile: fetched here for the check)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _python312() -> str | None:
    found = shutil.which("python3.12")
    if found and subprocess.run([found, "-c", "import sys"], capture_output=True).returncode == 0:
        return found
    return next(iter(sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))), None)


def _download(dest: Path, *packages: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                           "--platform", "manylinux_2_17_x86_64", "-d", str(dest), *packages], capture_output=True, text=True, timeout=300)  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"no package registry answered pip download ({done.stderr.strip().splitlines()[-1:]}): the wheels cannot be fetched here")


def test_the_carried_wheels_fit_16_mib_and_install_offline_into_a_working_kvikio(tmp_path: Path) -> None:
    py = _python312()
    if py is None:
        pytest.skip("needs a Python 3.12 interpreter (the GPU machine's) to install the wheels for")
    wheels = tmp_path / "wheels"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), str(wheels)], capture_output=True, text=True, timeout=300, cwd=REPO)
    if done.returncode != 0 and "pip" in done.stderr:
        pytest.skip(f"no package registry answered: {done.stderr.strip().splitlines()[-1:]}")
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in wheels.glob("*.whl"))
    total = sum(p.stat().st_size for p in wheels.glob("*.whl"))
    assert f"{total} bytes" in done.stdout and total < 16 << 20
    assert any(f.startswith("kvikio_cu13-26.10") for f in files) and any(f.startswith("libkvikio_cu13-26.10") for f in files)
    # What the GPU machine has of its own, for this check only.
    own = tmp_path / "own"
    _download(own, "numpy<3", "nvidia-cufile", "packaging")
    for src, target in ((wheels, tmp_path / "site"), (own, tmp_path / "machine")):
        inst = subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(target), *map(str, src.glob("*.whl"))],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert inst.returncode == 0, inst.stderr
    lib = next((tmp_path / "machine").glob("nvidia/*/lib"))
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}:{tmp_path / 'machine'}", LD_LIBRARY_PATH=str(lib))
    imp = subprocess.run([py, "-c", "import kvikio, kvikio.defaults; print(kvikio.__version__, kvikio.defaults.get('auto_direct_io_read'))"],
                         capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert imp.returncode == 0 and imp.stdout.startswith("26.10"), imp.stderr[-2000:]
