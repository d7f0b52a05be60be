#!/usr/bin/env bash
# GPU smoke check for gds_offload: run on a machine with an NVIDIA GPU, collect results.
#
# Usage: scripts/gpu_check.sh [--dry-run] OUTDIR
#
# It runs with the machine's own python3 (or $PYTHON) and its CUDA build of torch, and never
# installs torch. First it checks that CUDA works: if not, it writes the summary and exits 3
# with one line, "CUDA is not available". Parts, each with its own time limit that includes
# its own set-up (LIMIT_* below; they add up to at most GPU_CHECK_BUDGET_S, default 400 s,
# so the whole run stays under 7 minutes on one H200):
#   env      nvidia-smi and versions                       -> OUTDIR/nvidia-smi.txt, versions.json
#   install  what is missing (KvikIO), from the wheels in $GDS_WHEELS (default wheels/gpu/,
#            filled by scripts/gpu_wheels.sh on a machine with registry access):
#            pip install --no-index --no-deps --target OUTDIR/site; nothing is downloaded
#   pytest   the GPU-marked tests, exactness first: pytest -m "gpu or gds" (DALI's excluded:
#            its GPU reader opens the cuFile driver in-process)   -> OUTDIR/pytest.log, pytest.xml
#   pytest-dali  the DALI GPU tests, in a process of their own      -> OUTDIR/pytest-dali.log
#   plan     scripts/gpu_plan_run.py: plan a tiny model on the GPU and run it layer-major,
#            tokens torch.equal to resident                        -> OUTDIR/plan.json
#   check    gds-check --json (with bandwidth)             -> OUTDIR/gds-check.json
#   bench    python -m gds_offload.cli bench --device cuda (a GPT whose saved activations
#            dominate the step)                             -> OUTDIR/bench.json
#   bench-weights  python -m gds_offload.cli bench-weights --device cuda (a 90 MB model: resident,
#            streamed from the drive into GPU slots, pinned host tier, Accelerate disk offload;
#            outputs compared with resident)         -> OUTDIR/bench-weights.json, .png, .log
# and one summary, OUTDIR/gpu_check.json (schema gpu_check/2): nvidia-smi output, versions,
# and each part's command, exit code, duration and state (passed, failed, skipped, and why).
#
# --dry-run prints every command it would run and runs only the CPU-safe parts
# (gds-check --json --no-bench, pytest --collect-only -m "gpu or gds"); it exits 0
# when the summary was written.
#
# Environment: PYTHON (interpreter; default python3), GDS_WHEELS (folder of wheels for missing
# packages; default wheels/gpu), GDS_TEST_DIR (an NVMe directory for the gds-marked tests),
# GDS_CHECK_PATH (spill directory for gds-check; default its own).
# Exit code: 0 every part that ran passed; 1 a part failed; 3 CUDA is not available; 64 usage.
set -uo pipefail

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
if [ "$#" -ne 1 ]; then
    echo "usage: $0 [--dry-run] OUTDIR" >&2
    exit 64
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$1"
OUTDIR=$(cd "$1" && pwd)
PARTS="$OUTDIR/parts.tsv"
: > "$PARTS"
cd "$REPO" || exit 1

# The machine's python and its CUDA torch; the project's own .venv holds a CPU build of torch.
PY=${PYTHON:-python3}
SITE="$OUTDIR/site"
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# cuFile writes cufile.log into the working directory unless cufile.json says otherwise.
export CUFILE_LOGFILE_PATH="${CUFILE_LOGFILE_PATH:-$OUTDIR/cufile.log}"

log() { echo "gpu_check: $*" >&2; }

# Every part gets its own limit, and none runs past the whole script's deadline. The limits
# add up to the budget by construction (checked here, and by the dry run's summary).
LIMIT_SMI=5 LIMIT_VERSIONS=15 LIMIT_INSTALL=25 LIMIT_PYTEST=170 LIMIT_DALI=20 LIMIT_PLAN=30 LIMIT_CHECK=25
LIMIT_BENCH=60 LIMIT_WEIGHTS=50
BUDGET_S=${GPU_CHECK_BUDGET_S:-400}
PART_LIMITS_S=$(( LIMIT_SMI + LIMIT_VERSIONS + LIMIT_INSTALL + LIMIT_PYTEST + LIMIT_DALI + LIMIT_PLAN + LIMIT_CHECK + LIMIT_BENCH + LIMIT_WEIGHTS ))
if [ "$PART_LIMITS_S" -gt "$BUDGET_S" ]; then
    echo "gpu_check: the part limits add up to ${PART_LIMITS_S}s, over the ${BUDGET_S}s budget" >&2
    exit 64
fi
DEADLINE=$(( $(date +%s) + BUDGET_S ))

# run_part NAME LIMIT_S LOGFILE CMD... : run one part under `timeout` and record
# "name<TAB>rc<TAB>milliseconds<TAB>status<TAB>log<TAB>command" in $PARTS. stdout and stderr
# go to LOGFILE, or stdout to $PART_STDOUT when that is set.
run_part() {
    local name=$1 limit=$2 logfile=$3
    shift 3
    local shown left
    shown=$(printf '%q ' "$@")
    left=$(( DEADLINE - $(date +%s) ))
    if [ "$left" -lt 5 ]; then
        echo "+ (out of time, not run) ${shown% }" >&2
        printf '%s\t\t\tskipped (out of time)\t\t%s\n' "$name" "${shown% }" >> "$PARTS"
        return 124
    fi
    [ "$left" -lt "$limit" ] && limit=$left
    echo "+ ${shown% }" >&2
    local start end rc
    start=$(date +%s%N)
    if [ -n "${PART_STDOUT:-}" ]; then
        timeout --kill-after=5 "$limit" "$@" > "$PART_STDOUT" 2> "$logfile"
    else
        timeout --kill-after=5 "$limit" "$@" > "$logfile" 2>&1
    fi
    rc=$?
    end=$(date +%s%N)
    local status=ok
    [ "$rc" -ne 0 ] && status=failed
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status="timed out after ${limit}s"; fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( (end - start) / 1000000 ))" \
        "$status" "$logfile" "${shown% }" >> "$PARTS"
    return "$rc"
}

# skip_part NAME CMD... : print the command a dry run would have run, record it as skipped.
skip_part() {
    local name=$1
    shift
    local shown
    shown=$(printf '%q ' "$@")
    echo "+ (dry run, not run) ${shown% }" >&2
    printf '%s\t\t\tskipped (dry run)\t\t%s\n' "$name" "${shown% }" >> "$PARTS"
}

# ---- summary (written at the end, or at once when CUDA is not available) --------------------
write_summary() {
"$PY" - "$OUTDIR" "$PARTS" "$DRY_RUN" "$BUDGET_S" "$PART_LIMITS_S" <<'EOF'
import json, os, sys, time
outdir, parts_file, dry_run = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
budget_s, part_limits_s = int(sys.argv[4]), int(sys.argv[5])
def read(name):
    try:
        return open(os.path.join(outdir, name), encoding="utf-8", errors="replace").read()
    except OSError:
        return None
parts = []
for line in open(parts_file):
    name, rc, seconds, status, logfile, command = (line.rstrip("\n").split("\t") + [""] * 6)[:6]
    parts.append({
        "name": name,
        "command": command,
        "exit_code": int(rc) if rc.strip() else None,
        "duration_s": round(int(seconds) / 1000, 2) if seconds.strip() else None,
        "status": status,
        "log": logfile or None,
    })
try:
    versions = json.loads(read("versions.json") or "{}")
except ValueError:
    versions = {"error": read("versions.err")}
verdicts = {0: "gds", 1: "compat", 2: "unusable"}
for p in parts:  # each part's state: passed, failed, skipped (and why)
    st = p["status"]
    p["state"] = ("skipped" if st.startswith("skipped") or p["exit_code"] is None
                  else "passed" if p["exit_code"] == 0 or (p["name"].startswith("pytest") and p["exit_code"] == 5) else "failed")
    p["why"] = st
for p in parts:  # gds-check's exit code is its verdict
    if p["name"].startswith("gds-check") and p["exit_code"] in verdicts:
        p["status"] = "verdict " + verdicts[p["exit_code"]]
# pytest: 5 = no test selected (no GPU-marked test applies); gds-check: 0 gds, 1 compat;
# nvidia-smi is information only; bench may be an unknown command in this version.
acceptable = {"pytest": {0, 5}, "pytest-dali": {0, 5}, "pytest-collect": {0, 5}, "gds-check": {0, 1}, "gds-check-no-bench": {0, 1}}
failed = [p["name"] for p in parts
          if p["exit_code"] is not None and p["name"] != "nvidia-smi" and p["status"] != "unknown command"
          and p["exit_code"] not in acceptable.get(p["name"], {0})]
summary = {
    "schema": "gpu_check/2",
    "dry_run": dry_run,
    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    "nvidia_smi": read("nvidia-smi.txt"),
    "versions": versions,
    "parts": parts,
    "failed": failed,
    "gds_check_verdict": (json.loads(read("gds-check.json") or "{}") or {}).get("verdict"),
    "budget_s": budget_s,
    "part_limits_s": part_limits_s,
}
with open(os.path.join(outdir, "gpu_check.json"), "w") as fh:
    json.dump(summary, fh, indent=2)
print(json.dumps({"failed": failed, "parts": {p["name"]: p["status"] for p in parts}}))
sys.exit(1 if failed and not dry_run else 0)
EOF
}

# ---- CUDA, before anything else ---------------------------------------------------------
if [ "$DRY_RUN" = 0 ]; then
    CUDA_WHY=$(timeout 90 "$PY" -c 'import sys, torch
print("ok" if torch.cuda.is_available() else f"torch {torch.__version__} from {sys.executable}: torch.cuda.is_available() is False")' 2>&1 | tail -n 1)
    if [ "$CUDA_WHY" != ok ]; then
        printf 'cuda\t3\t0\tfailed: %s\t\t%s\n' "${CUDA_WHY:-$PY did not run}" "$PY -c torch.cuda.is_available()" >> "$PARTS"
        write_summary > /dev/null
        rm -f "$PARTS"
        echo "gpu_check: CUDA is not available (${CUDA_WHY:-$PY did not run}); run it on the GPU machine, with its python3 and CUDA torch (or PYTHON=...)" >&2
        exit 3
    fi
    printf 'cuda\t0\t0\tok\t\t%s\n' "$PY -c torch.cuda.is_available()" >> "$PARTS"
fi

# ---- env ------------------------------------------------------------------------------
if command -v nvidia-smi > /dev/null; then
    if [ "$DRY_RUN" = 1 ]; then
        skip_part nvidia-smi nvidia-smi
    else
        run_part nvidia-smi "$LIMIT_SMI" "$OUTDIR/nvidia-smi.txt" nvidia-smi
        nvidia-smi --query-gpu=index,name,memory.total,driver_version,pci.bus_id --format=csv \
            >> "$OUTDIR/nvidia-smi.txt" 2>&1
    fi
else
    echo "nvidia-smi not found on PATH" > "$OUTDIR/nvidia-smi.txt"
    printf 'nvidia-smi\t127\t0\tnot found\t%s\tnvidia-smi\n' "$OUTDIR/nvidia-smi.txt" >> "$PARTS"
fi


# ---- install --------------------------------------------------------------------------
# Only what the machine lacks (KvikIO; its torch, CuPy, pytest, rich are its own), from the
# carried wheels, into OUTDIR/site (on PYTHONPATH above): nothing downloaded, nothing replaced.
WHEELS=${GDS_WHEELS:-$REPO/wheels/gpu}
if timeout 30 "$PY" -c "import kvikio" > /dev/null 2>&1; then
    printf 'install\t\t\tskipped (nothing missing)\t\t\n' >> "$PARTS"
elif ! compgen -G "$WHEELS/*.whl" > /dev/null; then
    log "KvikIO is missing and $WHEELS holds no wheels (scripts/gpu_wheels.sh fills it); its tests will skip"
    printf 'install\t\t\tskipped (kvikio missing; no wheels in %s)\t\t\n' "$WHEELS" >> "$PARTS"
elif [ "$DRY_RUN" = 1 ]; then
    skip_part install "$PY" -m pip install --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
else
    run_part install "$LIMIT_INSTALL" "$OUTDIR/install.log" \
        "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
fi

# ---- versions (after the install, so they are what the tests run with) -----------------
timeout "$LIMIT_VERSIONS" "$PY" - > "$OUTDIR/versions.json" 2>> "$OUTDIR/versions.err" <<'EOF'
import importlib, json, platform, sys
out = {"python": sys.version.split()[0], "platform": platform.platform()}
for name in ("torch", "kvikio", "cupy", "numpy", "rich", "xxhash", "pytest", "gds_offload"):
    try:
        module = importlib.import_module(name)
        version = getattr(module, "__version__", None)
        if version is None:
            from importlib import metadata
            version = metadata.version(name)
        out[name] = str(version)
    except Exception as exc:  # report, never fail
        out[name] = None
        out[name + "_error"] = f"{type(exc).__name__}: {exc}"
try:
    import torch
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = torch.cuda.is_available()
    out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if out["cuda_available"] else []
except Exception as exc:
    out["torch_cuda_error"] = str(exc)
print(json.dumps(out))
EOF

# ---- pytest (GPU-marked tests) -----------------------------------------------------------
# Exactness first (the streamed weights and layer-major runs against resident); DALI's GPU
# reader opens the cuFile driver with compat allowed, so its tests run in a process of their own.
GPU_TESTS=(tests/test_weights_gpu.py tests/test_weights_layer_major_gpu.py tests)
if [ "$DRY_RUN" = 1 ]; then
    run_part pytest-collect 120 "$OUTDIR/pytest-collect.log" \
        "$PY" -m pytest --collect-only -q -m "gpu or gds" -p no:cacheprovider
    skip_part pytest "$PY" -m pytest -m "(gpu or gds) and not dali" -q -p no:cacheprovider --junitxml "$OUTDIR/pytest.xml" "${GPU_TESTS[@]}"
    skip_part pytest-dali "$PY" -m pytest -m "dali and (gpu or gds)" -q -p no:cacheprovider tests/test_data.py
    skip_part plan "$PY" scripts/gpu_plan_run.py "$OUTDIR/plan.json"
else
    run_part pytest "$LIMIT_PYTEST" "$OUTDIR/pytest.log" \
        "$PY" -m pytest -m "(gpu or gds) and not dali" -q -p no:cacheprovider --junitxml "$OUTDIR/pytest.xml" "${GPU_TESTS[@]}"
    run_part pytest-dali "$LIMIT_DALI" "$OUTDIR/pytest-dali.log" \
        "$PY" -m pytest -m "dali and (gpu or gds)" -q -p no:cacheprovider tests/test_data.py
    run_part plan "$LIMIT_PLAN" "$OUTDIR/plan.log" "$PY" scripts/gpu_plan_run.py "$OUTDIR/plan.json"
fi

# ---- gds-check -----------------------------------------------------------------------
CHECK_ARGS=(--json)
[ -n "${GDS_CHECK_PATH:-}" ] && CHECK_ARGS+=(--path "$GDS_CHECK_PATH")
if [ "$DRY_RUN" = 1 ]; then
    skip_part gds-check "$PY" -m gds_offload.check.cli "${CHECK_ARGS[@]}"
    CHECK_ARGS+=(--no-bench)
    CHECK_NAME=gds-check-no-bench
else
    CHECK_NAME=gds-check
fi
# stdout is the JSON document; stderr (progress bar, warnings) goes to gds-check.log.
PART_STDOUT="$OUTDIR/gds-check.json" run_part "$CHECK_NAME" "$LIMIT_CHECK" "$OUTDIR/gds-check.log" \
    "$PY" -m gds_offload.check.cli "${CHECK_ARGS[@]}"
"$PY" - "$OUTDIR/gds-check.json" "$OUTDIR/gds-check.log" <<'EOF'
import json, sys
try:
    json.load(open(sys.argv[1]))
except (OSError, ValueError):  # keep the file valid JSON, with what went wrong
    log = open(sys.argv[2], encoding="utf-8", errors="replace").read()[-4000:]
    out = open(sys.argv[1], encoding="utf-8", errors="replace").read()[-4000:]
    json.dump({"error": "gds-check printed no JSON document", "stdout": out, "stderr": log},
              open(sys.argv[1], "w"), indent=2)
EOF

# ---- training benchmark --------------------------------------------------------------------
# A small explicit model, so that every mode finishes inside the part's limit: GPT, 8 layers,
# hidden 1024, 16 heads, sequence 512, batch 4 (about 2 GiB saved per step in fp32), 1
# warm-up and 3 measured steps per mode, each mode in its own process.
BENCH=("$PY" -m gds_offload.cli bench --device cuda --layers 8 --hidden 1024 --heads 16 --seq 512 --batch 4
       --vocab 8192 --warmup 1 --steps 3 --modes "keep,offload:compat,offload:host"
       --timeout 25 --out "$OUTDIR/bench.json")
if [ "$DRY_RUN" = 1 ]; then
    # Parse the bench's arguments as the real run would, without starting it.
    run_part bench-args 20 "$OUTDIR/bench-args.log" "$PY" -c \
        'import sys; from gds_offload.cli import build_parser; build_parser().parse_args(sys.argv[1:])' "${BENCH[@]:3}"
    skip_part bench "${BENCH[@]}"
else
    run_part bench "$LIMIT_BENCH" "$OUTDIR/bench.log" "${BENCH[@]}"
    if grep -qiE "invalid choice|unknown command" "$OUTDIR/bench.log"; then
        # The subcommand is not in this version: record it and go on.
        sed -i -E 's/^(bench\t[0-9]+\t[^\t]*\t)[^\t]*/\1unknown command/' "$PARTS"
    fi
fi

# ---- weights benchmark (streamed inference on the GPU) ----------------------------------------
# Small enough for its limit (four children, each importing torch and CUDA); the store goes to
# GDS_TEST_DIR (an NVMe directory) when set, so the drive mode can use GPUDirect Storage there.
WEIGHTS_WORK="${GDS_TEST_DIR:-$OUTDIR}/gds_offload-bench-weights-$$"
WBENCH=("$PY" -m gds_offload.cli bench-weights --device cuda --hidden 512 --intermediate 1408 --layers 8
        --vocab 8000 --batch-sizes "1,8" --prompt-len 32 --new-tokens 5 --raw-depths "4,16"
        --workdir "$WEIGHTS_WORK" --out "$OUTDIR/bench-weights.json")
if [ "$DRY_RUN" = 1 ]; then
    skip_part bench-weights "${WBENCH[@]}"
else
    run_part bench-weights "$LIMIT_WEIGHTS" "$OUTDIR/bench-weights.log" "${WBENCH[@]}"
    rm -rf "$WEIGHTS_WORK"
fi

# ---- summary ---------------------------------------------------------------------------
write_summary
rc=$?
rm -f "$PARTS"
exit "$rc"
