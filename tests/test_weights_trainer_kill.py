"""Crash consistency of full fine-tuning: the trainer is SIGKILLed at random points of its steps
(``GDS_OFFLOAD_KILLS``, default 50), each time in a fresh process that resumes from the drive,
and after every kill the store's last complete step ``k`` is what the previous run had
finished or the one after it, with every weight torch.equal to resident training's after ``k`` steps.

The points are events, not times (``helpers/train_kill_child.py``): the child kills itself at
the ``N``-th layer forward or file operation after it resumed, ``N`` drawn from the events of
two steps, so where the kills land does not depend on the machine's speed."""
from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed (pip install 'gds_offload[hf]')")

from helpers.disks import real_disk_base  # noqa: E402
from helpers.llama import llama_config, resident_model, save_checkpoint  # noqa: E402
from helpers.train_kill_child import OPTIMIZER, batches  # noqa: E402

from gds_offload.weights import convert, export  # noqa: E402

CHILD = Path(__file__).parent / "helpers" / "train_kill_child.py"
KILLS = int(os.environ.get("GDS_OFFLOAD_KILLS", "50"))


class Reference:
    """Resident training of the same model, every parameter, one optimizer: its weights after ``k`` steps."""

    def __init__(self, ckpt: Path) -> None:
        self.model = resident_model(ckpt)
        for p in self.model.parameters():
            p.requires_grad_(True)
        self.opt = OPTIMIZER(list(self.model.parameters()))
        self.states = [{k: v.clone() for k, v in self.model.state_dict().items()}]

    def weights(self, k: int) -> dict[str, torch.Tensor]:
        while len(self.states) <= k:
            for b in batches(len(self.states) - 1):
                self.model(**b).loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.opt.step()
            self.opt.zero_grad()
            self.states.append({k: v.clone() for k, v in self.model.state_dict().items()})
        return self.states[k]


def test_a_kill_at_any_point_leaves_step_k_or_k_plus_1(tmp_path: Path) -> None:
    base = real_disk_base() / f"gds_offload-trainer-kill-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    try:
        ckpt = save_checkpoint(llama_config(), base / "ckpt")
        store = base / "store"
        convert(ckpt, store)
        ref = Reference(ckpt)
        progress = tmp_path / "progress.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CHILD.parent.parent), str(CHILD.parents[2]), os.environ.get("PYTHONPATH", "")])}
        server = subprocess.Popen([sys.executable, str(CHILD), str(store), str(progress)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=env)  # fmt: skip
        assert server.stdin is not None and server.stdout is not None
        rng, committed, per_step, landed = random.Random(0), 0, 0, set()

        def run(target: int) -> tuple[list[tuple[str, ...]], int]:
            """One child, killed at event ``target``: its progress lines and its wait status."""
            progress.write_text("")
            server.stdin.write(f"fork {target}\n")
            server.stdin.flush()
            pid = int(server.stdout.readline())
            server.stdin.write(f"reap {pid}\n")
            server.stdin.flush()
            status = int(server.stdout.readline())
            return [tuple(line.split()) for line in progress.read_text().splitlines() if line.strip()], status

        try:
            for i in range(KILLS):
                target = 0 if per_step == 0 else rng.randint(1, 2 * per_step)
                lines, status = run(target)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, f"kill {i}: the child ended otherwise ({status})"
                assert lines and lines[0] == ("ready", str(committed)), f"kill {i}: resumed at another step than the one on the drive"
                done = [(int(n), int(e)) for w, n, e in (line for line in lines[1:] if line[0] == "done")]
                if per_step == 0:
                    assert done, "the first run finished no step"
                    per_step = done[0][1]
                finished = max([n for n, _ in done], default=committed)
                out = tmp_path / f"export-{i}"
                k = export(store, out).step
                assert k in (finished, finished + 1), f"kill {i} at event {target}: step {k} on the drive, the run had finished {finished}"
                got = safetensors_torch.load_file(out / "model.safetensors")
                want = ref.weights(k)
                assert all(torch.equal(got[n], want[n]) for n in want), f"kill {i}: step {k}'s weights are not resident training's"
                landed.add(k - committed)
                committed = k
                shutil.rmtree(out)
        finally:
            server.kill()
            server.wait()
        assert committed >= KILLS // 4, f"only {committed} steps in {KILLS} runs: the kills landed before any step"
        assert 0 in landed or KILLS < 10, "no kill landed inside a step (before its commit)"
    finally:
        shutil.rmtree(base, ignore_errors=True)
