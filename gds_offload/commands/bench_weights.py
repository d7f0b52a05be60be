"""``gds-offload bench-weights``: inference tokens/s with weights resident, streamed from the
drive or host memory by :mod:`gds_offload.weights`, and under Accelerate's disk offload,
each mode in its own process (:mod:`gds_offload.bench.weights.bench`). Examples::

    gds-offload bench-weights --tiny                                  # seconds: the end-to-end check
    gds-offload bench-weights --memory-limit 1.2GiB --out docs/results/weights-cpu.json
    gds-offload bench-weights --tiny --device cuda --modes resident,drive,host --out /tmp/w.json

``--out`` writes the result file ``gds-offload report`` renders (and a PNG next to it, or at
``--plot``). Exit status: 0 every mode ran and matched the resident outputs, 1 one did not,
2 a usage error: every flag is checked before the first child starts (:func:`workdir_arg`,
:func:`memory_limit_arg` are shared with ``bench-finetune``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

HELP = "benchmark inference with weights resident, streamed from drive/host, and Accelerate disk offload"


def batch_sizes_arg(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers, e.g. 1,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: batch sizes must be positive integers")
    return values


def modes_arg(text: str, allowed: tuple[str, ...]) -> list[str]:
    """``--modes``: a comma-separated list of ``allowed`` names.

    Raises:
        ConfigError: an unknown name, or none.
    """
    from gds_offload.errors import ConfigError

    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in allowed]
    if bad or not modes:
        raise ConfigError(f"--modes {text!r}: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(allowed)}")
    return modes


def default_workdir(tiny: bool) -> Path:
    """``<tmp>/gds_offload-bench-weights[-tiny]-<uid>``: the user's own, private (0700) working directory."""
    return Path(tempfile.gettempdir()) / f"gds_offload-bench-weights{'-tiny' if tiny else ''}-{os.getuid()}"


def workdir_arg(given: str | None, *, tiny: bool) -> Path:
    """The working directory of ``--workdir``, or :func:`default_workdir`: judged as ``attach()``
    judges a spill directory (:func:`~gds_offload.io.directory.prepare_dir`; the default must be
    the user's own), created 0700 when missing.

    Raises:
        ConfigError: an empty ``--workdir``, or a directory ``attach()`` would refuse.
    """
    from gds_offload.errors import ConfigError
    from gds_offload.io.directory import prepare_dir

    if given is None:
        return prepare_dir(default_workdir(tiny), create=True, origin="default --workdir")
    if not given.strip():
        raise ConfigError(f"--workdir {given!r} is empty; pass a directory, or leave the flag out for {default_workdir(tiny)}")
    return prepare_dir(Path(given), create=True, origin="--workdir")


def memory_limit_arg(text: str | None) -> int | None:
    """``--memory-limit``: ``None`` when left out, else a cap this machine can apply
    (:func:`~gds_offload.bench.cgroup.check_limit`).

    Raises:
        ConfigError: not a size, 0, under 64 MiB, or no memory group can be made here.
    """
    from gds_offload.bench.cgroup import check_limit
    from gds_offload.units import parse_bytes

    if text is None:
        return None
    limit = parse_bytes(text, name="--memory-limit")
    check_limit(limit, name=f"--memory-limit {text}")
    return limit


def add_arguments(p: argparse.ArgumentParser) -> None:
    from gds_offload.commands.run_args import positive_int

    p.add_argument("--tiny", action="store_true", help="a 4-layer hidden-64 model, short prompt: runs in seconds")
    p.add_argument("--modes", default="resident,drive,host,accelerate-disk", help="comma-separated (default: all four)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--hidden", type=positive_int, default=None, help="hidden size (default 2048)")
    p.add_argument("--intermediate", type=positive_int, default=None, help="MLP size (default 5632)")
    p.add_argument("--layers", type=positive_int, default=None, help="decoder layers (default 12)")
    p.add_argument("--vocab", type=positive_int, default=None, help="vocabulary (default 16000)")
    p.add_argument("--dtype", default=None, help="float32 (default) or bfloat16")
    p.add_argument("--batch-sizes", type=batch_sizes_arg, default=None, help="comma-separated (default 1,8,64)")
    p.add_argument("--prompt-len", type=positive_int, default=None, help="prompt tokens (default 16)")
    p.add_argument("--new-tokens", type=positive_int, default=None, help="tokens generated per sequence, the first by the prefill (default 3)")
    p.add_argument("--rounds", type=positive_int, default=1, help="run every mode this many times, interleaved; medians are shown (default 1)")
    p.add_argument("--repeats", type=positive_int, default=1, help="measurements per batch size inside each child (default 1)")
    p.add_argument("--slots", type=positive_int, default=2, help="ring buffers of the drive mode (default 2)")
    p.add_argument("--threads", type=positive_int, default=None, help="engine threads of the streamed modes (default: 4 on the CPU, the engine's on a GPU)")
    p.add_argument("--engine", default="auto", help="engine of the drive mode: auto, gds, compat, posix (default auto)")
    p.add_argument("--raw-depths", default="1,4,8", help="requests in flight of the raw O_DIRECT read passes (default 1,4,8)")
    p.add_argument("--checkpoint", type=Path, default=None, help="use this safetensors checkpoint (Llama-like) instead of random weights")
    p.add_argument("--workdir", default=None, help="where the checkpoint and store go (default: a private <tmp>/gds_offload-bench-weights-<uid>)")
    p.add_argument("--memory-limit", default=None, help="cap the drive and accelerate-disk children (page cache included), e.g. 1.2GiB; needs root and cgroup v1")
    p.add_argument("--out", "--json", dest="out", metavar="OUT", default=None, help="write the result file (JSON) to OUT ('-': print it instead of the table)")
    p.add_argument("--plot", default=None, help="PNG of tokens/s against batch size (default: OUT with .png; '' for none)")
    p.add_argument("--title", default=None, help="the result's title on the performance page")


#: ``--dtype`` values: the weights' dtype in every mode.
DTYPES = ("float32", "bfloat16")


def _depths(text: str) -> tuple[int, ...]:
    from gds_offload.errors import ConfigError

    try:
        depths = tuple(int(d) for d in text.split(",") if d.strip())
    except ValueError:
        raise ConfigError(f"--raw-depths {text!r} is not a comma-separated list of integers, e.g. 1,4,8") from None
    if not depths or min(depths) < 1:
        raise ConfigError(f"--raw-depths {text!r}: requests in flight must be positive integers (0 is not 'the default': leave the flag out)")
    return depths


def run(args: argparse.Namespace) -> int:
    from gds_offload.bench.weights.bench import DEFAULT_MODEL, MODES, TINY, BenchSpec, run_bench
    from gds_offload.commands.run_args import resolve_device
    from gds_offload.errors import ConfigError
    from gds_offload.io.factory import validate_mode

    try:  # every flag, before the checkpoint is made and the first child starts
        modes = modes_arg(args.modes, MODES)
        if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
            raise ConfigError(f"--device {args.device!r}: expected cpu or cuda")
        device = resolve_device(args.device)  # a CUDA device this machine has
        if args.dtype is not None and args.dtype not in DTYPES:
            raise ConfigError(f"--dtype {args.dtype!r}: expected {' or '.join(DTYPES)}")
        try:
            validate_mode(args.engine)
        except ConfigError as exc:
            raise ConfigError(f"--engine {args.engine!r}: {exc}") from None
        model = TINY if args.tiny else DEFAULT_MODEL
        over = (("hidden", args.hidden), ("intermediate", args.intermediate), ("layers", args.layers), ("vocab", args.vocab), ("dtype", args.dtype))
        model = replace(model, **{k: v for k, v in over if v is not None})
        defaults = ((1, 2), 16, 4) if args.tiny else ((1, 8, 64), 16, 3)
        batches = args.batch_sizes or defaults[0]
        depths = _depths(args.raw_depths)
        new_tokens = args.new_tokens or defaults[2]
        if args.rounds < 1 or args.repeats < 1 or new_tokens < 2 or min(batches) < 1:
            raise ConfigError(f"--rounds {args.rounds} --repeats {args.repeats} --batch-sizes {batches}: at least 1 each; --new-tokens {new_tokens}: at least 2")
        limit = memory_limit_arg(args.memory_limit)
        workdir = workdir_arg(args.workdir, tiny=args.tiny)  # last: it creates the directory
        spec = BenchSpec("", "", "", str(workdir), batch_sizes=batches, prompt_len=args.prompt_len or defaults[1], new_tokens=new_tokens,
                         slots=args.slots, num_threads=args.threads, repeats=args.repeats, engine=args.engine, device=device)  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-weights: {exc}")
        return 2
    from rich.console import Console

    from gds_offload.bench.docs.report import current_commit

    console = Console(stderr=True)
    started = time.time()
    commit = current_commit()  # before the run writes its plot and results into the checkout
    try:
        report = run_bench(spec, modes, model=model, rounds=args.rounds, memory_limit=limit, checkpoint=args.checkpoint,
                           interference_s=0.2 if args.tiny else 2.0,
                           raw_depths=depths, progress=lambda text: console.log(text))  # fmt: skip
    except ConfigError as exc:
        print(f"gds-offload bench-weights: {exc}", file=sys.stderr)
        return 2
    emit(_document(args, report, started, workdir, commit), args.out)
    failed = [r for r in report["summary"] if r["rounds_ok"] < r["rounds"] or r["matches_resident"] is False]
    return 1 if failed else 0


def _document(args: argparse.Namespace, report: dict[str, Any], started: float, workdir: Path, commit: str | None) -> dict[str, Any]:
    from gds_offload.bench.machine import describe_machine
    from gds_offload.bench.weights.doc import document, fastest_raw, plot
    from gds_offload.units import format_bytes

    m, spec = report["model"], report["spec"]
    size = format_bytes(m["layers_nbytes"] + m["resident_nbytes"])
    cap = f"a {format_bytes(spec['memory_limit_bytes'])} memory cap (page cache included)" if spec["memory_limit_bytes"] else "no memory cap"
    raw = (fastest_raw(report) or 0) / 1e9
    loads = [x for r in report["results"] if r.get("load_avg") for x in r["load_avg"]]
    load = f"; the machine's load average went from {min(loads):.1f} to {max(loads):.1f} on {os.cpu_count()} CPUs" if loads else ""
    about = (f"A {m['layers']}-layer Llama-shaped model ({size} of {m['dtype']} weights, random, from a safetensors checkpoint) on {spec['device']}, "
             f"prompt {spec['prompt_len']} tokens, {spec['new_tokens'] - 1} decode steps; streamed-drive and accelerate-disk under {cap}, "
             f"resident and streamed-host uncapped (they hold every weight in memory); every child with MALLOC_MMAP_THRESHOLD_=1048576; "
             f"{spec['rounds']} round(s) interleaved, medians. "
             f"The drive's fastest raw O_DIRECT read pass in the same run: {raw:.2f} GB/s{load}; the decodes of streamed-drive and "
             f"accelerate-disk at each batch size are also run {spec.get('paired_raw', 0)} more times after the measured runs, each "
             f"between raw passes of as many bytes of the file the mode reads, in its own process (x raw around it: the median; the "
             f"two modes' use of the drive compares free of its drift). On the resident and streamed-host rows, "
             f"x Accelerate is the ceiling a streamer that cost nothing would reach{_interference_line(report)}.")  # fmt: skip
    title = args.title or f"Weights streamed from NVMe for inference ({spec['device']})"
    plot_path = None
    if args.out and args.out != "-" and args.plot != "":
        target = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
        try:
            plot(report, target, title=title)
            plot_path = target.as_posix()
        except ImportError as exc:
            print(f"gds-offload bench-weights: no plot: {exc}")
    started_s = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started))
    return document(report, title=title, about=about, command=getattr(args, "command_line", "gds-offload bench-weights"), commit=commit,
                    machine=describe_machine(workdir).as_dict(), started=started_s, wall_s=time.time() - started, plot_path=plot_path)  # fmt: skip


def _interference_line(report: dict[str, Any]) -> str:
    probe = report.get("interference")
    if not probe:
        return ""
    return (f". Compute shaped like the model's MLP ran {probe['slowdown']:.2f}x slower beside O_DIRECT reads at "
            f"{probe['read_bytes_per_s'] / 1e9:.2f} GB/s than alone (same run): what reading costs the compute on this machine")


def emit(doc: dict[str, Any], out: str | None) -> None:
    """Write the result file to ``out`` and print the table, or print the file (``out="-"``)."""
    if out and out != "-":
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if out == "-":
        print(json.dumps(doc, indent=2, default=str))
    else:
        render(doc)


def render(doc: dict[str, Any]) -> None:
    """Print the result's table and targets (rich)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=doc["title"], caption=doc["about"])
    for col in doc["table"]["columns"]:
        t.add_column(col, justify="left" if col == "mode" else "right", no_wrap=col == "mode")
    for row in doc["table"]["rows"]:
        t.add_row(*row)
    console = Console(width=max(160, Console().width))
    console.print(t)
    for x in doc.get("targets") or []:
        verdict = {True: "[green]met[/]", False: "[red]not met[/]", None: "not measured"}[x["met"]]
        value = "-" if x["value"] is None else f"{x['value']:.2f}"
        ceiling = f" (resident: {x['ceiling']:.2f})" if x.get("ceiling") else ""
        console.print(f"target {x['target']} >= {x['need']}: {value} {verdict}{ceiling}")
