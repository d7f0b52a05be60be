"""Measuring a streamed model on this machine for the planner (:mod:`gds_offload.weights.planning.planner`):
:func:`measure` returns a :class:`~gds_offload.weights.planning.planner.Profile`. What is measured,
and how it stays inside a memory limit: :mod:`gds_offload.weights.run.profile`.

The measurements run in the calling process (or, with ``isolate=True``, in a child process,
``python -m gds_offload.weights.run.measure``): its base memory is then everything the process holds,
as the run it plans for will hold it, and nothing beside it needs room under a memory limit.

The child prints one JSON object per line: ``{"event": "progress", ...}`` while it works, then
``{"event": "profile", ...}``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from gds_offload.errors import ConfigError
from gds_offload.runtime.malloc import predictable_malloc, release_free
from gds_offload.units import format_bytes
from gds_offload.weights.planning.workload import Finetune, Profile, Workload, profile_from
from gds_offload.weights.run.profile import profile_generate
from gds_offload.weights.run.profile_finetune import profile_finetune
from gds_offload.weights.run.skeleton import empty_model

__all__ = ["measure", "main", "memory_limit"]

_TIMEOUT_S = 600


def _child(spec: dict[str, Any], say: Callable[[str], None], stack: contextlib.ExitStack) -> dict[str, Any]:
    """The profile of ``spec``'s model, as a dict (:func:`~gds_offload.weights.planning.workload.profile_from`); ``say`` reports
    progress; the streamed model is closed when ``stack`` closes (also after an exception)."""
    predictable_malloc()  # as generate_many runs: the memory measured is the memory held
    store = Path(spec["store"])
    device = torch.device(spec["device"])
    cfg = transformers.AutoConfig.from_pretrained(store)
    skeleton = empty_model(cfg)  # every architecture load_streamed streams (computed buffers real)
    run = profile_finetune if spec.get("kind") == "finetune" else profile_generate
    return run(spec, skeleton, cfg, store, device, say, stack)


def measure(
    store: str | os.PathLike[str],
    workload: Workload,
    *,
    device: str = "cpu",
    engine: str = "auto",
    progress: Callable[[str], None] | None = None,
    isolate: bool = False,
    memory: int | None = None,
) -> Profile:
    """Profile the model in ``store`` for ``workload`` on ``device`` (see the module doc).

    Args:
        isolate: measure in a child process (``python -m gds_offload.weights.run.measure``), whose base
            memory is the model's and a fresh interpreter's. Default: in this process, whose base is
            everything it holds, as the run it plans for will hold it; nothing beside it needs room
            (a child and its parent together pass a memory limit that the run alone fits), and this
            process's random-number state is left as it was.
        memory: the plan's memory limit: refused once the resident group is loaded, before anything
            is timed, if below what the smallest plan needs (:func:`~gds_offload.weights.planning.planner.check_floor`).

    Raises:
        ConfigError: the measurement failed: the child's error, or how it ended (a kill by the
            kernel's out-of-memory killer names the memory limit it ran under); ``memory`` too small.
    """
    spec: dict[str, Any] = {"store": os.fspath(store), "device": device, "engine": engine, "memory": memory,
                            "workload": dataclasses.asdict(workload)}  # fmt: skip
    if isinstance(workload, Finetune):
        spec |= {"kind": "finetune", "seq": workload.seq, "global_batch": workload.global_batch, "lora_r": workload.lora_r}
    else:
        spec |= {"kind": "generate", "prompt_len": workload.prompt_len, "new_tokens": workload.new_tokens, "prompts": workload.prompts}
    if isolate:
        return profile_from(_in_child(spec, progress))
    dev = torch.device(device)
    devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), contextlib.ExitStack() as stack:
            return profile_from(_child(spec, progress or (lambda what: None), stack))
    finally:
        # The measured model and its hooks reference each other: only the cycle collector frees
        # them, and the run this plan is for loads the model again (a second resident group). The
        # heap's free memory goes back too: the run's base is what the plan counted, not its leftovers.
        release_free()


def _in_child(spec: dict[str, Any], progress: Callable[[str], None] | None) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "gds_offload.weights.run.measure", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    result: dict[str, Any] | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "progress" and progress is not None:
                progress(event["what"])
            elif event.get("event") == "profile":
                result = event["profile"]
        _, err = proc.communicate(timeout=_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode == 0 and result is not None:
        return result
    raise ConfigError(f"measuring {spec['store']} failed: {_how_it_ended(proc.returncode, err or '')}")


def _how_it_ended(returncode: int, err: str) -> str:
    """A failed measuring child's end, in words: its own error line, or the signal that ended it."""
    if returncode < 0:
        import signal

        name = signal.Signals(-returncode).name if -returncode in signal.Signals._value2member_map_ else f"signal {-returncode}"
        if -returncode == signal.SIGKILL:
            limit = memory_limit()
            where = f" of {format_bytes(limit)}" if limit is not None else ""
            return (f"the measuring process was killed ({name}), most likely by the kernel's out-of-memory killer at this "
                    f"process group's memory limit{where}; measure in this process (isolate=False), or give more memory")  # fmt: skip
        return f"the measuring process was ended by {name}"
    ours = [line for line in err.strip().splitlines() if line.startswith("gds_offload.weights.run.measure:")]
    last = ours[-1:] or [line for line in err.strip().splitlines() if line.strip() and "Warning" not in line][-1:]
    return last[0] if last else f"exit {returncode}"


def memory_limit() -> int | None:
    """The memory limit of this process's memory cgroup (v1 ``memory.limit_in_bytes`` or v2
    ``memory.max``), or ``None`` when there is none or it cannot be read."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"
        elif controllers == "":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"
        else:
            continue
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def _emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        with contextlib.ExitStack() as stack:
            profile = _child(json.loads(args[0]), lambda what: _emit("progress", what=what), stack)
    except ConfigError as exc:
        print(f"gds_offload.weights.run.measure: {exc}", file=sys.stderr)
        return 2
    _emit("profile", profile=profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
