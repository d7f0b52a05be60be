"""Where each rank spills: one spill location per process of a distributed job.

:func:`rank_path` turns ``attach(path=...)`` into this process's directories, from the
launcher's environment (:func:`rank_env`: torchrun, ``accelerate``/DeepSpeed/Lightning
launchers, which set the same variables, or SLURM's ``srun``):

====================================  =======================================================
``path``                              what rank ``r`` (local rank ``l`` on its node) gets
====================================  =======================================================
``None`` (the default)                ``<default>``; under a distributed launch (world size
                                      above 1) ``<default>/rank<r>``, created 0700
                                      (``local<l>`` if the launcher names no global rank)
``"/mnt/nvme{local_rank}/spill"``     the template filled in: ``{local_rank}`` from
                                      ``LOCAL_RANK`` (``SLURM_LOCALID`` under srun),
                                      ``{rank}`` from ``RANK`` (``SLURM_PROCID``); a list of
                                      templates stripes over the filled directories
``per_rank([d0, d1, ...])``           entry ``l`` (a directory, or a list of them to stripe);
``per_rank({0: d0, 1: d1})``          the same, keyed by local rank
``"auto"``                            the NVMe drive closest to this rank's GPU
                                      (:func:`~gds_offload.activations.spill.placement.auto_placement`), in a
                                      per-rank subdirectory
a directory or list without fields    as given, on every rank
====================================  =======================================================

Why ``per_rank(...)`` and not a plain list: a list already means "stripe every tensor
over these directories" (one process, several drives), and a list of local-rank
directories looks the same. A plain dict would do, but launchers and config files
(YAML, JSON, ``TrainingArguments``) turn its keys into strings, and ``{0: [a, b]}``
versus ``[[a, b]]`` is easy to get wrong; ``per_rank`` says what it means at the call
site, checks its entries when it is built, and a list stays a stripe.

Two ranks never share a file: every spill file is an unnamed file of one process
(:mod:`gds_offload.io.spill`). The default path and ``"auto"`` also give each rank its own
directory; an explicit directory without a rank field is shared by the ranks that name
it (their files stay apart; they share the drive's space and bandwidth).

Directories this module chooses (the default, ``"auto"``) are created 0700 when
missing; directories the caller names (templates, ``per_rank``) must exist, as for
any explicit ``path``. Nothing here imports torch at module import.

Every form of ``path`` in the table resolves in :func:`place_rank`, here: each answer is a
:class:`~gds_offload.activations.spill.placement.Placement` under the same per-rank directory and creation
rules, and the table above stays next to the code that implements it. What ``"auto"``
needs beyond that (probing the node's GPUs and NVMe drives, ranking the drives by PCIe
distance) is :mod:`gds_offload.activations.spill.placement`.
"""
from __future__ import annotations

import difflib
import os
import string
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from gds_offload.activations.spill.placement import AutoNode, Placement, auto_placement, model_gpu, probe_node
from gds_offload.activations.spill.placement import nvme_candidates as nvme_candidates  # re-exported: callers of place_rank() find it here
from gds_offload.errors import ConfigError
from gds_offload.io.directory import default_spill_dir, prepare_dir

__all__ = [
    "RankEnv",
    "PerRank",
    "Placement",
    "per_rank",
    "rank_env",
    "rank_path",
    "place_rank",
    "node_placements",
    "auto_placement",
    "AUTO",
]

#: ``attach(path="auto")``: the closest NVMe drive per rank.
AUTO = "auto"

_Dir = Union[str, "os.PathLike[str]"]

#: Template fields and the variables that fill them, per launcher.
_FIELDS: dict[str, dict[str, str]] = {
    "torchrun": {"rank": "RANK", "local_rank": "LOCAL_RANK"},
    "slurm": {"rank": "SLURM_PROCID", "local_rank": "SLURM_LOCALID"},
}


# --------------------------------------------------------------------------------------
# Which process this is
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankEnv:
    """This process's place in a distributed job, as its launcher described it.

    Attributes:
        launcher: ``torchrun`` (``RANK``/``LOCAL_RANK``/``WORLD_SIZE``: torchrun,
            ``accelerate launch``, the DeepSpeed and Lightning launchers), ``slurm``
            (``SLURM_PROCID``/``SLURM_LOCALID``/``SLURM_NTASKS``), ``torch.distributed``
            (a process group initialised without those variables: rank known, local rank
            not), or ``none``.
        rank: global rank, None when not launched as part of a job.
        local_rank: rank on this node, None when the launcher does not say.
        world_size: processes in the job (1 outside a launch).
        local_world_size: processes on this node, None when the launcher does not say.
    """

    launcher: str = "none"
    rank: int | None = None
    local_rank: int | None = None
    world_size: int = 1
    local_world_size: int | None = None

    @property
    def distributed(self) -> bool:
        """More than one process in the job (per-rank default directories apply)."""
        return self.world_size > 1 or bool(self.rank)

    @property
    def subdir(self) -> str:
        """This process's directory under a shared base: ``rank<rank>``, or ``local<local rank>``
        when the launcher gives only the local rank."""
        if self.rank is None and self.local_rank is not None:
            return f"local{self.local_rank}"
        return f"rank{self.rank or 0}"

    def value(self, name: str) -> int | None:
        """The value of a template field (``rank`` or ``local_rank``)."""
        return self.rank if name == "rank" else self.local_rank


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name, "").strip()
    if not text:
        return None
    head = text.split("(")[0].split(",")[0]  # SLURM_TASKS_PER_NODE looks like "4(x2)" or "4,2"
    try:
        value = int(head)
    except ValueError:
        raise ConfigError(f"environment variable {name}={text!r} is not an integer; the launcher sets it, so unset or fix it") from None
    if value < 0:
        raise ConfigError(f"environment variable {name}={text!r} is negative; the launcher sets it, so unset or fix it")
    return value


def rank_env(env: Mapping[str, str] | None = None) -> RankEnv:
    """Read this process's rank from the launcher's environment.

    torchrun's variables win over SLURM's (``srun torchrun ...`` sets both; torchrun's
    describe the process). An initialised ``torch.distributed`` default group gives the
    rank where ``RANK`` is missing (Lightning sets only ``LOCAL_RANK``), or where no
    launcher variable is set (local rank unknown then). Only ``torch.distributed`` already imported
    is consulted: this never imports torch.

    Args:
        env: the environment; ``os.environ`` when None.

    Returns:
        The :class:`RankEnv`.

    Raises:
        ConfigError: a launcher variable is set but not a non-negative integer.
    """
    env = os.environ if env is None else env
    group = _initialised_group() if env is os.environ else None
    if any(k in env for k in ("RANK", "LOCAL_RANK")):
        rank = _env_int(env, "RANK")
        world = _env_int(env, "WORLD_SIZE")
        if rank is None and group is not None:  # Lightning sets LOCAL_RANK and WORLD_SIZE, not RANK
            rank, world = group
        return RankEnv("torchrun", rank, _env_int(env, "LOCAL_RANK"), world or 1, _env_int(env, "LOCAL_WORLD_SIZE"))
    if "SLURM_PROCID" in env:
        return RankEnv(
            "slurm",
            _env_int(env, "SLURM_PROCID"),
            _env_int(env, "SLURM_LOCALID"),
            _env_int(env, "SLURM_NTASKS") or _env_int(env, "SLURM_NPROCS") or 1,
            _env_int(env, "SLURM_NTASKS_PER_NODE") or _env_int(env, "SLURM_TASKS_PER_NODE"),
        )
    if group is not None:
        return RankEnv("torch.distributed", group[0], None, group[1], None)
    return RankEnv()


def _initialised_group() -> tuple[int, int] | None:
    """(rank, world size) of torch.distributed's default group when one is initialised (never imports torch)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank(), dist.get_world_size()


# --------------------------------------------------------------------------------------
# per_rank(...)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerRank:
    """One spill location per local rank; build it with :func:`per_rank`.

    Attributes:
        dirs: local rank -> its directories (several: striped, as a plain list would be).
    """

    dirs: Mapping[int, tuple[str, ...]]

    def for_local_rank(self, env: RankEnv) -> tuple[str, ...]:
        """The directories of this process's local rank.

        Raises:
            ConfigError: the local rank is unknown, or has no entry.
        """
        if env.local_rank is None:
            raise ConfigError(
                f"path={self!r} picks a directory by local rank, but this process has none "
                f"({_missing_vars(env, 'local_rank')}); launch with torchrun or srun, or set LOCAL_RANK"
            )
        if env.local_rank not in self.dirs:
            raise ConfigError(
                f"path={self!r} has entries for local ranks {', '.join(map(str, sorted(self.dirs)))}, but this process "
                f"is local rank {env.local_rank}; give one directory per process on the node"
            )
        return self.dirs[env.local_rank]

    def __repr__(self) -> str:
        items = ", ".join(f"{k}: {list(v) if len(v) > 1 else v[0]!r}" for k, v in sorted(self.dirs.items()))
        return f"per_rank({{{items}}})"


def per_rank(dirs: Sequence[_Dir | Sequence[_Dir]] | Mapping[int | str, _Dir | Sequence[_Dir]]) -> PerRank:
    """Spill locations indexed by local rank, for ``attach(path=...)``.

    Args:
        dirs: a list whose entry ``l`` is local rank ``l``'s directory, or a dict
            ``{local_rank: directory}`` (keys may be digit strings, as config files give
            them). An entry may itself be a list of directories: that rank stripes over
            them. Entries may use ``{rank}``/``{local_rank}`` like any path.

    Returns:
        A :class:`PerRank`.

    Raises:
        ConfigError: no entries, a key that is not a local rank, an empty entry, or an
            entry that is not a path.

    Example::

        gds_offload.attach(model, path=gds_offload.per_rank(["/mnt/nvme0/spill", "/mnt/nvme1/spill"]))
    """
    if isinstance(dirs, (str, os.PathLike)):
        raise ConfigError(f"per_rank({dirs!r}) got one directory; pass a list (one entry per local rank) or a dict")
    items: list[tuple[Any, Any]] = list(dirs.items()) if isinstance(dirs, Mapping) else list(enumerate(dirs))
    if not items:
        raise ConfigError("per_rank() got no entries; pass one directory per local rank")
    out: dict[int, tuple[str, ...]] = {}
    for key, value in items:
        try:
            local = int(key)
        except (TypeError, ValueError):
            local = -1
        if local < 0 or isinstance(key, bool) or (isinstance(key, str) and not key.strip().isdigit()):
            raise ConfigError(f"per_rank key {key!r} is not a local rank (an integer >= 0)")
        entry = [value] if isinstance(value, (str, os.PathLike)) else list(value) if isinstance(value, Sequence) else None
        if not entry or not all(isinstance(d, (str, os.PathLike)) for d in entry):
            raise ConfigError(f"per_rank entry {local}={value!r} must be a directory or a non-empty list of directories")
        out[local] = tuple(os.fspath(d) for d in entry)
    return PerRank(out)


# --------------------------------------------------------------------------------------
# Templates
# --------------------------------------------------------------------------------------
def template_fields(text: str) -> tuple[str, ...]:
    """The ``{fields}`` named in ``text`` (``{{`` and ``}}`` are literal braces).

    Raises:
        ConfigError: a malformed template, or a field other than ``rank``/``local_rank``.
    """
    try:
        names = [name for _, name, spec, conv in string.Formatter().parse(text) if name is not None]
    except ValueError as exc:
        raise ConfigError(f"path={text!r} is not a valid template ({exc}); write literal braces as {{{{ and }}}}") from None
    for name in names:
        if name not in ("rank", "local_rank"):
            hint = difflib.get_close_matches(name, ("rank", "local_rank"), n=1)
            raise ConfigError(
                f"path={text!r} names {{{name}}}; a spill path may name {{rank}} and {{local_rank}}"
                + (f" (did you mean {{{hint[0]}}}?)" if hint else "; write literal braces as {{ and }}")
            )
    return tuple(names)


def _missing_vars(env: RankEnv, name: str) -> str:
    if env.launcher in _FIELDS:
        return f"{env.launcher} set no {_FIELDS[env.launcher][name]}"
    if env.launcher == "torch.distributed":
        return "the process group knows the rank, not the local rank, and LOCAL_RANK is unset"
    a, b = _FIELDS["torchrun"][name], _FIELDS["slurm"][name]
    return f"neither {a} (torchrun) nor {b} (srun) is set"


def fill_template(text: str, env: RankEnv) -> str:
    """``text`` with ``{rank}``/``{local_rank}`` filled from ``env``.

    Raises:
        ConfigError: a field this process has no value for (naming the variable to set),
            or an unknown field.
    """
    names = template_fields(text)
    if not names:
        return text
    values = {}
    for name in names:
        value = env.value(name)
        if value is None:
            raise ConfigError(
                f"path={text!r} names {{{name}}}, but {_missing_vars(env, name)}: launch with torchrun or srun, "
                f"set {_FIELDS['torchrun'][name]}, or pass a plain directory"
            )
        values[name] = value
    return text.format(**values)


# --------------------------------------------------------------------------------------
# path= resolved: for this rank, or for every rank of a node
# --------------------------------------------------------------------------------------
def place_rank(path: Any, env: RankEnv | None = None, *, gpu: int | None = None, node: AutoNode | None = None) -> Placement:
    """Where this process (or the one ``env`` describes) spills, for ``attach(path=path)``.

    Args:
        path: what ``attach`` got: None, a directory or template, a list of them,
            :func:`per_rank`, or ``"auto"``.
        env: the rank; :func:`rank_env` of this process when None.
        gpu: for ``"auto"``: the CUDA index of the rank's GPU (default: its local rank).
        node: for ``"auto"``: the probed node (probed here when None).

    Returns:
        The :class:`Placement`. Nothing is created.

    Raises:
        ConfigError: a template field or per-rank entry this process has no value for, a
            dict (use :func:`per_rank`), an empty list, or an entry that is not a path.
    """
    env = rank_env() if env is None else env
    if path is None:
        base = default_spill_dir()
        if not env.distributed:
            return Placement(env.rank, env.local_rank, (base,), "default", changed=False)
        mine = base / env.subdir
        return Placement(env.rank, env.local_rank, (mine,), "default, per rank", create=(base, mine))
    if isinstance(path, str) and path == AUTO:
        node = probe_node() if node is None else node
        return auto_placement(env, node, gpu=gpu)
    if isinstance(path, PerRank):
        dirs = path.for_local_rank(env)
        return Placement(env.rank, env.local_rank, tuple(Path(fill_template(d, env)) for d in dirs), "per_rank")
    if isinstance(path, Mapping):
        raise ConfigError(
            f"path={path!r} is a dict; for one directory per local rank write path=gds_offload.per_rank({path!r}) "
            "(a plain list already means: stripe over these directories)"
        )
    if isinstance(path, (str, os.PathLike)):
        texts = [os.fspath(path)]
    elif isinstance(path, Sequence):
        texts = list(path)
        if not texts:
            raise ConfigError("path=[] names no directory; pass a directory or a list of them")
        if not all(isinstance(t, (str, os.PathLike)) for t in texts):
            raise ConfigError(f"path={path!r}: every entry of a list must be a directory (str or os.PathLike)")
        texts = [os.fspath(t) for t in texts]
    else:
        raise ConfigError(f"path={path!r} is a {type(path).__name__}; pass a directory, a list of them, per_rank(...) or 'auto'")
    filled = [fill_template(t, env) for t in texts]
    if filled == texts:
        return Placement(env.rank, env.local_rank, tuple(Path(t) for t in texts), "as given", changed=False)
    return Placement(env.rank, env.local_rank, tuple(Path(t) for t in filled), "template")


def rank_path(
    path: Any, *, model: Any = None, env: Mapping[str, str] | None = None
) -> str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None:
    """``attach(path=...)`` resolved for this process: what ``attach`` then treats as a plain path.

    Returns ``path`` unchanged when nothing is rank-specific (no launch and no field, or
    a plain directory); else the rank's directory (or list of them), after creating the
    ones this module chose (the per-rank default, ``"auto"``) with mode 0700.

    Args:
        path: as given to :func:`~gds_offload.attach`.
        model: the model being attached; ``"auto"`` places by the GPU its parameters are on.
        env: the environment (``os.environ`` when None).

    Raises:
        ConfigError: see :func:`place_rank`; also a directory that cannot be created.
    """
    renv = rank_env(env)
    chosen = place_rank(path, renv, gpu=model_gpu(model) if isinstance(path, str) and path == AUTO else None)
    if not chosen.changed:
        return path
    for d in chosen.create:  # the private base (0700) first, so no rank directory is made under a 0755 parent
        prepare_dir(d, create=True)
    return list(chosen.paths) if len(chosen.paths) > 1 else chosen.paths[0]


def node_placements(path: Any, local_world_size: int, env: Mapping[str, str] | None = None, *, root: Path = Path("/")) -> list[Placement]:
    """The placement of every local rank of this node, as a launch of ``local_world_size``
    processes here would get it (``gds-check --ranks``). Nothing is created.

    Args:
        path: as for :func:`place_rank`.
        local_world_size: processes on this node.
        env: the environment to start from (``os.environ`` when None); ``GROUP_RANK`` or
            ``SLURM_NODEID`` gives the node's position, ``WORLD_SIZE``/``SLURM_NTASKS`` the job size.
        root: root of ``/proc`` and ``/sys`` for ``"auto"``.
    """
    env = os.environ if env is None else env
    node_rank = _env_int(env, "GROUP_RANK") or _env_int(env, "SLURM_NODEID") or 0
    world = max(local_world_size, _env_int(env, "WORLD_SIZE") or _env_int(env, "SLURM_NTASKS") or 0)
    node = probe_node(root) if isinstance(path, str) and path == AUTO else None
    out = []
    for local in range(local_world_size):
        renv = RankEnv("torchrun", node_rank * local_world_size + local, local, world, local_world_size)
        out.append(place_rank(path, renv, node=node))
    return out
