"""Every command an error suggests runs, as written, from where the user is.

An error that suggests a command writes it in single backticks (an upper-case word, such as
``CHECKPOINT`` or ``FILE...``, is what the user fills in: what the error cannot know).
:func:`test_every_suggested_command_is_tried_here` finds each such command in the package's
sources (outside ``bench/``); every one is tried below: the error is made to happen as a user
would meet it, the command is taken from its message, the upper-case words filled in, and the
command run in ``bash`` from the directory the user was in. It must succeed (``gds-check``:
exit 0 or 1, its verdict on a node with or without GPUDirect Storage).
"""
from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import llama_config, meta_skeleton, save_checkpoint  # noqa: E402

from gds_offload.errors import ConfigError, GDSUnavailableError  # noqa: E402
from gds_offload.weights import StoreCorruptError, StoreFormatError, convert, load_streamed, read_manifest, verify_store  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"`((?:gds-offload|gds-check)\b[^`]*)`")

#: Each suggested command in the sources, as ``(file, the command with "{}" for what is filled in)``:
#: the test below that makes its error happen and runs it, or why none does here.
SITES: dict[tuple[str, str], str] = {
    ("gds_offload/weights/store/advice.py", "gds-offload convert {} {}"): "test_a_checkpoint_passed_as_the_store",
    ("gds_offload/weights/store/advice.py", "gds-offload convert CHECKPOINT {}"): "test_a_missing_store_and_a_directory_of_other_files",
    ("gds_offload/weights/store/advice.py", "gds-offload convert --force {}"): "test_a_damaged_store_is_converted_again",
    ("gds_offload/weights/planning/planner.py", "gds-offload plan STORE --memory SIZE --out {}"): "test_a_missing_plan_file",
    ("gds_offload/data/format.py", "gds-offload shards {} --text FILE..."): "test_missing_or_bad_shards",
    ("gds_offload/data/format.py", "gds-offload shards {} --text FILE... --overwrite"): "test_missing_or_bad_shards",
    ("gds_offload/data/format.py", "gds-offload shards DIR --text FILE... --overwrite"): "test_missing_or_bad_shards",
    ("gds_offload/data/loader.py", "gds-offload shards {} --text FILE... --seq {} --windows-per-file {} --overwrite"): "test_missing_or_bad_shards",
    ("gds_offload/data/loader.py", "gds-offload shards --check {}"): "a warning on a GPU machine without libcufile (the same command as gds-offload shards --check in test_data.py)",
    ("gds_offload/node/choice.py", "gds-check --path {}"): "test_gds_asked_for_where_it_is_not_usable",
    ("gds_offload/io/kvikio/engine.py", "gds-check --path {}"): "cuFile refusing a file in GDS mode: a GPU node (the same command as in test_gds_asked_for_where_it_is_not_usable)",
    ("gds_offload/commands/report.py", "gds-offload report{}"): "test_a_stale_performance_page",
    ("gds_offload/cli.py", "gds-offload --help"): "test_no_command_given",
    ("gds_offload/cli.py", "gds-offload demo"): "the README's first command, which CI runs (about a minute)",
}


def _docstrings(tree: ast.AST) -> set[int]:
    kinds = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, kinds) and n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)}  # fmt: skip


def _text(node: ast.AST) -> str:
    """A string literal's text, ``{}`` for each formatted value."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else ""
    assert isinstance(node, ast.JoinedStr), "only string literals are read"
    return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def suggested_in_sources() -> set[tuple[str, str]]:
    """Every backticked command in the package's string literals (docstrings and ``bench/`` left out)."""
    found = set()
    for path in sorted((ROOT / "gds_offload").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("gds_offload/bench/"):
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree) | {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Constant, ast.JoinedStr)) and id(node) not in skip:
                found |= {(rel, m) for m in COMMAND.findall(_text(node))}
    return found


def test_every_suggested_command_is_tried_here() -> None:
    found = suggested_in_sources()
    assert found - SITES.keys() == set(), "a command suggested in an error, not tried by any test here: add its case to SITES"
    assert SITES.keys() - found == set(), "SITES names commands the sources no longer suggest"


# ---------------------------------------------------------------------------------- running one
def _env() -> dict[str, str]:
    env = dict(os.environ, COLUMNS="200", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def suggestions(message: str) -> list[str]:
    return COMMAND.findall(message)


def run_suggestion(message: str, cwd: Path, **fill: str) -> subprocess.CompletedProcess[str]:
    """Run the one command ``message`` suggests, in ``cwd``, its upper-case words replaced by
    ``fill`` (``FILE...`` by ``fill["FILE"]``); it must succeed."""
    commands = suggestions(message)
    assert len(commands) == 1, f"one command expected in: {message}"
    command = commands[0]
    for word, value in fill.items():
        command = re.sub(rf"\b{word}\b(\.\.\.)?", value, command)
    assert not re.search(r"\b[A-Z]{3,}\b", command), f"a word left to fill in: {command}"
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)
    ok = (0, 1) if command.startswith("gds-check") else (0,)
    assert done.returncode in ok, f"`{command}` (suggested by: {message}) exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
    return done


@pytest.fixture
def here() -> Iterator[Path]:
    """A directory on a real disk (the store wants O_DIRECT), the user's working directory, with a tiny checkpoint in it."""
    base = real_disk_base() / f"gds_offload-advice-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    save_checkpoint(llama_config(), base / "ckpt")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


# ---------------------------------------------------------------------------------- the cases
def test_a_checkpoint_passed_as_the_store(here: Path) -> None:
    """``gds-offload plan CKPT`` and ``load_streamed(skeleton, CKPT)`` name a new directory to convert
    into (``convert CKPT CKPT`` is refused), and the store made there loads."""
    done = subprocess.run(["gds-offload", "plan", "ckpt", "--memory", "1GiB"], cwd=here, env=_env(), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 2 and "is a Hugging Face checkpoint, not a weight store" in done.stderr, done.stderr
    with pytest.raises(StoreFormatError) as caught:
        load_streamed(meta_skeleton(here / "ckpt"), here / "ckpt")
    assert suggestions(str(caught.value)) == [f"gds-offload convert {here / 'ckpt'} {here / 'ckpt-store'}"]
    run_suggestion(done.stderr, here)
    load_streamed(meta_skeleton(here / "ckpt"), here / "ckpt-store").close()


def test_a_missing_store_and_a_directory_of_other_files(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(here)
    with pytest.raises(StoreFormatError) as caught:
        load_streamed(meta_skeleton(here / "ckpt"), "nostore")  # relative, as the user typed it
    run_suggestion(str(caught.value), here, CHECKPOINT="ckpt")
    assert read_manifest(here / "nostore").layers
    (here / "notes").mkdir()
    (here / "notes" / "todo.txt").write_text("x")
    with pytest.raises(StoreFormatError) as caught:
        read_manifest(here / "notes")
    run_suggestion(str(caught.value), here, CHECKPOINT="ckpt")
    assert read_manifest(here / "notes-store").layers


def test_a_missing_parent_names_the_disk_and_suggests_nothing_it_cannot_run(here: Path) -> None:
    with pytest.raises(StoreFormatError) as caught:
        load_streamed(meta_skeleton(here / "ckpt"), here / "nvme9" / "store")
    assert "nearest existing parent is" in str(caught.value) and suggestions(str(caught.value)) == []


@pytest.mark.parametrize("damage", ["format version", "corrupt bytes", "format 1 tie"])
def test_a_damaged_store_is_converted_again(here: Path, damage: str) -> None:
    ckpt, store = here / "ckpt", here / "store"
    if damage == "format 1 tie":  # the config ties the head to the embeddings; the checkpoint holds both, unequal
        cfg = json.loads((ckpt / "config.json").read_text())
        (ckpt / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    convert(ckpt, store)
    manifest = json.loads((store / "manifest.json").read_text())
    if damage == "format version":
        (store / "manifest.json").write_text(json.dumps(manifest | {"format_version": 99}))
        with pytest.raises(StoreFormatError) as caught:
            read_manifest(store)
    elif damage == "corrupt bytes":
        with open(store / "weights.bin", "r+b") as f:
            f.seek(manifest["groups"][0]["offset"])
            f.write(b"\xff" * 64)
        with pytest.raises(StoreCorruptError) as caught:
            verify_store(store)
    else:
        manifest["format_version"] = 1
        manifest.pop("generation_config_sha256", None)
        for t in manifest["tensors"]:
            del t["xxh3_64"]
        (store / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ConfigError) as caught:
            load_streamed(meta_skeleton(ckpt), store)
    assert suggestions(str(caught.value)) == [f"gds-offload convert --force {ckpt} {store}"], str(caught.value)
    run_suggestion(str(caught.value), here)
    verify_store(store)


def test_a_missing_plan_file(here: Path) -> None:
    """``from_pretrained(plan="p.json")`` before the plan was written says how to write it; then it loads."""
    from gds_offload.weights import Plan, from_pretrained

    ckpt = save_checkpoint(llama_config(max_position_embeddings=128), here / "ckpt128")  # room for the plan command's default workload
    convert(ckpt, here / "store")
    with pytest.raises(ConfigError) as caught:
        from_pretrained(ckpt, store=here / "store", plan=here / "p.json", progress=False)
    run_suggestion(str(caught.value), here, STORE="store", SIZE="8GiB")
    assert Plan.load(here / "p.json").choice.slots >= 1


def _text_file(here: Path) -> Path:
    text = here / "book.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 400)
    return text


def test_missing_or_bad_shards(here: Path) -> None:
    from gds_offload.data import TokenLoader
    from gds_offload.data.format import scan_shards

    book = str(_text_file(here))
    data = here / "data"
    for state in ("missing", "empty", "no index", "bad header"):
        if state == "empty":
            data.mkdir()
        with pytest.raises(ConfigError) as caught:
            scan_shards(data)
        run_suggestion(str(caught.value), here, FILE=book, DIR=str(data))
        scan_shards(data)
        if state == "missing":
            shutil.rmtree(data)
        elif state == "empty":
            (data / "shards.json").unlink()
        elif state == "no index":
            first = sorted(data.glob("*.npy"))[0]
            first.write_bytes(b"not a numpy file" * 300)
    with pytest.raises(ConfigError) as caught:
        TokenLoader(data, batch_size=1, seq=512, num_shards=4, shard_id=0, device="cpu")
    run_suggestion(str(caught.value), here, FILE=book)
    TokenLoader(data, batch_size=1, seq=512, num_shards=4, shard_id=0, device="cpu")


def test_gds_asked_for_where_it_is_not_usable(here: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from gds_offload.node.choice import choose_engine

    try:
        choose_engine("gds", here)
    except GDSUnavailableError as exc:
        run_suggestion(str(exc), here)
    else:
        pytest.skip("GPUDirect Storage is usable here: no error to follow")
    monkeypatch.chdir(here)
    with pytest.raises(GDSUnavailableError) as caught:  # no path: the current directory, named as such
        choose_engine("gds", None)
    assert suggestions(str(caught.value)) == [f"gds-check --path {here}"]


def test_a_stale_performance_page(tmp_path: Path) -> None:
    page = tmp_path / "performance.md"
    done = subprocess.run(["gds-offload", "report", "--check", "--out", str(page), "--readme", ""], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stderr
    run_suggestion(done.stderr, ROOT)
    assert page.is_file()


def test_no_command_given() -> None:
    done = subprocess.run(["gds-offload"], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "no command given" in done.stderr, done.stderr
    assert suggestions(done.stderr) == ["gds-offload demo", "gds-offload --help"]
    help_text = subprocess.run(["gds-offload", "--help"], env=_env(), capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "activations" in help_text.stdout and "weights" in help_text.stdout
