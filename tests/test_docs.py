"""Every code block of README.md and docs/*.md runs, as written, and passes.

Python blocks run in a fresh interpreter after a small prelude that gives them what a reader's
own program would have: ``model`` (a tiny Hugging Face Llama built from a config, nothing
downloaded), ``loader`` (batches of ``input_ids``/``labels``), ``optimizer``, ``input_ids``,
``device`` (``"cuda"`` where there is a GPU, else ``"cpu"``) and, for the weight store's
block, a tiny checkpoint at ``llama-ckpt/`` (4 layers: the planner profiles
two streamed layers besides the first). Shell blocks run line by line in ``bash``, the
package's commands on ``PATH``. Each block runs in a temporary directory, with the example
drive ``/mnt/nvme0`` mapped into it. A block marked ``<!-- needs: cuda -->`` (or another
device) above its fence is skipped where that is missing; ``<!-- run: ci -->`` marks the
set-up and test commands, which this suite cannot run inside itself: for those it checks that
``.ci/run`` runs each of them (through the scripts it calls).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.snippets import Block, code_blocks

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [b for doc in DOCS for b in code_blocks(doc) if b.lang in ("python", "sh", "bash")]
#: Where the examples put their drive; mapped into the test's directory.
EXAMPLE_DRIVE = "/mnt/nvme0"

PRELUDE = '''
import torch, transformers
torch.manual_seed(0)
_cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
model = transformers.LlamaForCausalLM(_cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
_ids = torch.randint(0, 256, (3, 2, 16), generator=torch.Generator().manual_seed(1))
loader = [{"input_ids": x, "labels": x} for x in _ids]
input_ids = _ids[0]
device = "cuda" if torch.cuda.is_available() else "cpu"
'''
CHECKPOINT = '''
import torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False)
transformers.LlamaForCausalLM(cfg).save_pretrained("llama-ckpt")
'''


def _missing(needs: tuple[str, ...]) -> str:
    """What of ``needs`` this machine lacks ("" when nothing)."""
    for need in needs:
        if need in ("cuda", "gpu") and not torch.cuda.is_available():
            return "an NVIDIA GPU (CUDA)"
        if need == "gpus" and torch.cuda.device_count() < 2:
            return "several NVIDIA GPUs"
        if need == "gds" and not Path("/proc/driver/nvidia-fs").exists():
            return "GPUDirect Storage (the nvidia-fs driver)"
    return ""


def _env() -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", COLUMNS="160")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _here(text: str, tmp: Path) -> str:
    return text.replace(EXAMPLE_DRIVE, str(tmp / "nvme0"))


def _checkpoint(tmp: Path) -> None:
    subprocess.run([sys.executable, "-c", CHECKPOINT], cwd=tmp, env=_env(), check=True, capture_output=True, timeout=300)


def _ci_commands(script: Path, seen: frozenset[Path] = frozenset()) -> list[str]:
    """The command lines ``script`` runs, with those of each ``bash scripts/...`` it calls."""
    lines = []
    for raw in script.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(("set ", "cd ", "export ")):
            continue
        words = line.split()
        while len(words) > 1 and re.match(r"[A-Za-z_]\w*=", words[0]):  # VAR=value command: the command
            words.pop(0)
        line = " ".join(words)
        lines.append(line)
        if words[0] == "bash" and len(words) > 1 and (REPO / words[1]).is_file():
            called = (REPO / words[1]).resolve()
            if called not in seen:
                lines += _ci_commands(called, seen | {called})
    return lines


def _check_ci_runs(block: Block) -> None:
    """Each command of the README's set-up and test block (``a && b`` is two) is one that ``.ci/run`` runs, with at most extra flags."""
    ran = _ci_commands(REPO / ".ci" / "run")
    for line in block.text.splitlines():
        for command in filter(None, (c.strip() for c in line.split("#", 1)[0].split("&&"))):
            assert any(r == command or r.startswith(command + " ") for r in ran), f"{block.where}: .ci/run never runs {command!r} (it runs {ran})"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_code_block_runs(block: Block, tmp_path: Path) -> None:
    if block.run == "ci":
        _check_ci_runs(block)
        return
    missing = _missing(block.needs)
    if missing:
        pytest.skip(f"{block.where} needs {missing}")
    (tmp_path / "nvme0").mkdir(mode=0o700)
    if "llama-ckpt" in block.text:
        _checkpoint(tmp_path)
    text = _here(block.text, tmp_path)
    if block.lang == "python":
        done = subprocess.run([sys.executable, "-c", PRELUDE + text], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip
        assert done.returncode == 0, f"{block.where} failed:\n{block.text}\n{done.stdout[-2000:]}{done.stderr[-4000:]}"
        return
    for line in text.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        done = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
        # gds-check's exit code is its verdict: 0 gds, 1 compat (a node without GDS); 2 would be "unusable".
        ok = (0, 1) if command.startswith("gds-check") else (0,)
        assert done.returncode in ok, f"{block.where}: `{line.strip()}` exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def test_every_block_is_found_and_marked() -> None:
    """The blocks above are all of them: each is python or shell, or a picture (no language)."""
    langs = {b.lang for doc in DOCS for b in code_blocks(doc)}
    assert langs <= {"python", "sh", "bash", ""}, langs
    assert any(b.lang == "python" for b in BLOCKS) and any(b.run == "ci" for b in BLOCKS)


def test_import_gds_offload_gives_its_subpackages() -> None:
    """``import gds_offload`` then ``gds_offload.weights.convert`` and
    ``gds_offload.integrations.transformers.OffloadCallback`` (as the README writes them): the
    subpackages, and the integrations in theirs, are attributes imported on first use
    (transformers with its integration, not with the package)."""
    code = ("import gds_offload, sys\n"
            "assert 'gds_offload.weights' not in sys.modules and 'transformers' not in sys.modules\n"
            "print(gds_offload.weights.convert.__name__, gds_offload.data.TokenLoader.__name__,\n"
            "      gds_offload.integrations.__name__, gds_offload.models.GPTConfig.__name__, gds_offload.io.make_engine.__name__)\n"
            "print(type(gds_offload.integrations.transformers.OffloadCallback(path='spill')).__name__)\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["convert", "TokenLoader", "gds_offload.integrations", "GPTConfig", "make_engine", "OffloadCallback"]
    import gds_offload

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gds_offload.nope  # noqa: B018
    with pytest.raises(AttributeError, match="the integrations: transformers"):
        gds_offload.integrations.nope  # noqa: B018


def _tree_files(text: str) -> set[str]:
    """The files docs/architecture.md's tree lists (paths under ``gds_offload/``), from its indentation."""
    block = text.split("## Files", 1)[1].split("```", 2)[1]
    stack: list[str] = []
    files: set[str] = set()
    for line in block.splitlines()[2:]:  # after the opening fence's line and "gds_offload/"
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2 - 1
        words = line.split()
        del stack[depth:]
        if words[0].endswith("/"):
            stack.append(words[0].rstrip("/"))
            continue
        for word in words:
            if word.endswith(".py") and "/" not in word:
                files.add("/".join([*stack, word]))
            elif not word.endswith(".py"):
                break
    return files


def test_architecture_lists_every_file_of_the_package() -> None:
    """docs/architecture.md's tree stays true: one line for each module there is, none for one there is not."""
    listed = _tree_files((REPO / "docs" / "architecture.md").read_text())
    actual = {p.relative_to(REPO / "gds_offload").as_posix() for p in (REPO / "gds_offload").rglob("*.py")}
    assert listed == actual, f"not in the tree: {sorted(actual - listed)}; in the tree but gone: {sorted(listed - actual)}"


def test_old_module_paths_import_with_a_warning() -> None:
    """gds_offload.offloader and gds_offload.policy (the paths before the layout of activations/) still import, for one release."""
    code = ("import warnings\nwarnings.simplefilter('error', DeprecationWarning)\n"
            "for name in ('gds_offload.offloader', 'gds_offload.policy'):\n"
            "    try:\n        __import__(name)\n    except DeprecationWarning as w:\n        print(w)\n"
            "    else:\n        raise SystemExit(name + ' imported without a DeprecationWarning')\n"
            "warnings.resetwarnings(); warnings.simplefilter('ignore')\n"
            "from gds_offload.offloader import attach, offloader_of\nfrom gds_offload.policy import Budget, Adaptive\n"
            "import gds_offload\nassert attach is gds_offload.attach and Budget is gds_offload.Budget\n")
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr + done.stdout
    assert "use gds_offload.attach" in done.stdout and "use gds_offload.Budget" in done.stdout
