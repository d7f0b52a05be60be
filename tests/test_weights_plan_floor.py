"""The least memory a plan needs is one number, said before anything is timed: the whole process
with the resident group loaded, a layer and one sequence's activations, rounded up to the MiB so
that giving exactly it fits, and the same number the planner would give after measuring."""
from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'gds_offload[hf]')")

from helpers.llama import converted  # noqa: E402

from gds_offload.errors import ConfigError  # noqa: E402
from gds_offload.units import parse_bytes  # noqa: E402
from gds_offload.weights import plan  # noqa: E402
from gds_offload.weights.planning.planner import Generate, at_least, check_floor  # noqa: E402

MiB = 1 << 20
W = Generate(prompts=8, prompt_len=8, new_tokens=4)
CONFIG = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


def _advice(exc: BaseException) -> int:
    found = re.search(r"give at least (\d+ MiB)", str(exc))
    assert found, str(exc)
    return parse_bytes(found.group(1).replace(" ", ""))


@pytest.mark.parametrize("base_mib", [100.0, 266.3, 1000.01])
def test_giving_exactly_the_advice_fits_and_a_mib_less_does_not(base_mib: float) -> None:
    kw = dict(layers=4, layer_nbytes=150_000, resident_nbytes=140_000, base_nbytes=int(base_mib * MiB))
    with pytest.raises(ConfigError, match="memory counts this whole process") as refused:
        check_floor(CONFIG, W, 12 * MiB, **kw)  # type: ignore[arg-type]
    need = _advice(refused.value)
    check_floor(CONFIG, W, need, **kw)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as again:
        check_floor(CONFIG, W, need - MiB, **kw)  # type: ignore[arg-type]
    assert _advice(again.value) == need
    assert at_least(need * 0.9) == f"{need // MiB} MiB"


@pytest.fixture(scope="module")
def store() -> Iterator[Path]:
    with converted("plan-floor") as (_, store):
        yield store


def test_too_little_memory_is_refused_once_loaded_before_anything_is_timed(store: Path) -> None:
    said: list[str] = []
    with pytest.raises(ConfigError, match="memory counts this whole process") as refused:
        plan(store, W, memory="12MiB", progress=said.append)
    assert said == ["loading the resident group"], "refused before any layer was read or timed"
    need = _advice(refused.value)
    chosen = plan(store, W, memory=need + MiB)  # the measurement's own noise (this process grew a little) aside
    assert chosen.predicted.peak_nbytes <= 0.9 * (need + MiB)


def test_a_profile_taken_on_a_busy_machine_says_so(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    with pytest.warns(UserWarning, match=r"measured while other work ran: .*the load average was 64\.0 on \d+ cores before measuring"):
        plan(store, W, memory="4GiB")
