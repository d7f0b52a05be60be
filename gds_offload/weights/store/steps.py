"""A trained store's steps: two generations of its weights and optimizer state, and the one
file that says which is complete (for :class:`~gds_offload.weights.train.trainer.StreamedTrainer`).

The converted store is never written. Training keeps, in its own directory (``STORE/train``
by default):

* ``weights-G.I.bin`` (``G`` = 0 or 1, ``I`` = the store's data file): every group of the
  store at the offsets its manifest gives, so the store's layout reads it as it reads ``weights.bin``;
* ``state-G.GROUP.bin``: the optimizer state of one group's parameters (each tensor at a
  multiple of 256 bytes, the file's length a multiple of 4 KiB);
* ``step.json``: the last complete step: its number, its generation, the xxh3-64 of every
  group and state file it wrote, and where each state tensor lies.

Step ``k + 1`` writes the generation ``step.json`` does not name (its files are unlinked and
made again), fsyncs every file, then replaces ``step.json`` (written whole as
``step.json.partial``, fsynced, renamed, the directory fsynced). A kill at any point leaves
``step.json`` naming step ``k`` (whose files nothing wrote) or step ``k + 1`` (all of whose
files are on the drive): never a mix. Reading a step checks every checksum against ``step.json``.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from gds_offload.errors import ConfigError
from gds_offload.io.base import Engine, IOFuture
from gds_offload.io.fds import close_fd
from gds_offload.io.integrity import checksum
from gds_offload.io.layout import ALIGN, File, Slot, align_up
from gds_offload.weights.errors import StoreCorruptError, StoreFormatError
from gds_offload.weights.store.files import StoreFiles, aligned_host_buffer, read_group
from gds_offload.weights.store.manifest import DTYPE_SIZES, TENSOR_ALIGN, FileEntry, GroupEntry, Manifest
from gds_offload.weights.store.outdir import write_small_file
from gds_offload.weights.store.trust import check_name, create_file, make_dirs, open_dir, open_file, read_file

__all__ = ["STEP_NAME", "GroupRead", "StateEntry", "StateRead", "Step", "Generations", "StepWriter", "pack_state", "unpack_state"]

STEP_NAME = "step.json"
_STEP_LIMIT = 64 << 20
_FORMAT = "gds_offload-train-step"


@dataclass(frozen=True)
class StateEntry:
    """One optimizer-state tensor of a group: ``state[param][key]``, ``nbytes`` at ``offset`` of its state file."""

    param: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Step:
    """A complete training step of a store (``step == 0``, ``generation is None``: the converted store)."""

    step: int = 0
    generation: int | None = None
    #: group name -> xxh3-64 of its bytes in this generation's weight files.
    groups: dict[str, int] = field(default_factory=dict)
    #: group name -> its state tensors, and the xxh3-64 of its state file's data.
    states: dict[str, tuple[StateEntry, ...]] = field(default_factory=dict)
    state_xxh3: dict[str, int] = field(default_factory=dict)


def pack_state(entries: list[tuple[str, str, torch.Tensor]]) -> tuple[tuple[StateEntry, ...], torch.Tensor, int]:
    """``(param, key, tensor)`` (host tensors) -> their layout, one page-aligned buffer holding them, its data bytes."""
    layout, offset = [], 0
    for param, key, t in entries:
        offset = -(-offset // TENSOR_ALIGN) * TENSOR_ALIGN
        nbytes = t.numel() * t.element_size()
        layout.append(StateEntry(param, key, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, nbytes))
        offset += nbytes
    buf = aligned_host_buffer(max(align_up(offset), ALIGN))
    buf.zero_()
    for e, (_, _, t) in zip(layout, entries):
        buf[e.offset : e.offset + e.nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
    return tuple(layout), buf, offset


def unpack_state(layout: tuple[StateEntry, ...], buf: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors :func:`pack_state` packed, as ``{param: {key: tensor}}``: views of ``buf`` (which
    they keep alive), each at a :data:`TENSOR_ALIGN`-byte offset."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for e in layout:
        t = buf[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        out.setdefault(e.param, {})[e.key] = t
    return out


def _check(data: torch.Tensor, want: int, where: str) -> None:
    """Raise :class:`StoreCorruptError` naming ``where`` unless ``data`` hashes to ``want`` (xxh3-64)."""
    got = checksum(data)
    if got != want:
        raise StoreCorruptError(f"{where} is corrupt: xxh3-64 {got:016x}, expected {want:016x}; "
                                f"restore the training directory or start again from the store")  # fmt: skip


@dataclass(eq=False)
class GroupRead:
    """A weight group being read (:meth:`Generations.start_group`)."""

    future: IOFuture
    buf: torch.Tensor
    nbytes: int
    xxh3: int
    where: str

    def wait(self) -> torch.Tensor:
        """The group's bytes (a page-aligned buffer of its padded size).

        Raises:
            StoreCorruptError: the bytes' xxh3-64 is not the step's.
            OffloadError: the read failed.
        """
        self.future.wait()
        _check(self.buf[: self.nbytes], self.xxh3, self.where)
        return self.buf

    def close(self) -> None:
        """Wait for the read to land (its buffer is in use until then), whatever it gave."""
        with contextlib.suppress(Exception):
            self.future.wait()


@dataclass(eq=False)
class StateRead:
    """A state file being read (:meth:`Generations.start_state`); :meth:`wait` once."""

    future: IOFuture | None
    buf: torch.Tensor | None
    layout: tuple[StateEntry, ...]
    end: int
    xxh3: int
    path: str
    fd: int = -1

    def wait(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state, ``{param: {key: tensor}}`` (views of the read buffer, which they keep alive).

        Raises:
            StoreCorruptError: the bytes' xxh3-64 is not the step's.
            OffloadError: the read failed.
        """
        if self.future is None or self.buf is None:
            return {}
        try:
            self.future.wait()
        finally:
            self.close()  # the file; the read has landed
        _check(self.buf[: self.end], self.xxh3, self.path)
        return unpack_state(self.layout, self.buf)

    def holds(self, entries: list[tuple[str, str, torch.Tensor]]) -> bool:
        """``entries`` (``(param, key, tensor)``) are this read's tensors, in its layout, where it put
        them: an optimizer that updated the state in place, whose buffer is then the new state file."""
        if self.buf is None or len(entries) != len(self.layout):
            return False
        base = self.buf.data_ptr()
        return all(
            (p, k) == (e.param, e.key) and str(t.dtype).removeprefix("torch.") == e.dtype and tuple(t.shape) == e.shape
            and t.is_contiguous() and t.data_ptr() == base + e.offset
            for e, (p, k, t) in zip(self.layout, entries)
        )  # fmt: skip

    def close(self) -> None:
        """Wait for the read (its buffer is in use until it lands) and close the file; idempotent."""
        if self.fd < 0:
            return
        try:
            if self.future is not None:
                with contextlib.suppress(Exception):
                    self.future.wait()
        finally:
            close_fd(self)


class Generations:
    """The training directory ``root`` of the store described by ``manifest`` (in ``store_dirs``)."""

    def __init__(self, root: Path, manifest: Manifest, store_dirs: list[Path]) -> None:
        self.root, self.manifest, self.store_dirs = root, manifest, store_dirs
        self.current = self._read_step() if os.path.lexists(root) else Step()

    # -- reading ------------------------------------------------------------------------------
    def files(self, step: Step | None = None) -> StoreFiles:
        """The weight files of ``step`` (default: the current one), opened read-only."""
        s = step or self.current
        if s.generation is None:
            return StoreFiles(self.store_dirs, self.manifest)
        return StoreFiles([self.root], self._generation_manifest(s.generation), converted=False)

    def group_xxh3(self, group: GroupEntry) -> int:
        """What ``group``'s bytes hash to in the current step."""
        return self.current.groups.get(group.name, group.xxh3_64) if self.current.generation is not None else group.xxh3_64

    def read_group(self, engine: Engine, files: StoreFiles, group: GroupEntry) -> torch.Tensor:
        """``group``'s bytes in the current step (a page-aligned host buffer of its padded size), checked."""
        return self.start_group(engine, files, group).wait()

    def start_group(self, engine: Engine, files: StoreFiles, group: GroupEntry) -> GroupRead:
        """Start reading ``group``'s bytes in the current step from ``files`` (open until it lands);
        :meth:`GroupRead.wait` checks them."""
        buf = aligned_host_buffer(group.padded_nbytes)
        where = f"{group.describe()} in {self.root} (step {self.current.step})"
        return GroupRead(read_group(engine, files, group, buf), buf, group.nbytes, self.group_xxh3(group), where)

    def read_state(self, engine: Engine, group: str) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer state of ``group``'s parameters in the current step (``{}`` before the first), checked."""
        return self.start_state(engine, group).wait()

    def start_state(self, engine: Engine, group: str) -> StateRead:
        """Start reading ``group``'s state file of the current step through ``engine`` (``O_DIRECT``
        where the filesystem allows) into a page-aligned buffer; :meth:`StateRead.wait` checks it.

        Raises:
            StoreFormatError: the file is missing, short, or not the size a state file is written at.
            StoreTrustError: see :func:`~gds_offload.weights.store.trust.open_file`.
        """
        s = self.current
        layout = s.states.get(group)
        if s.generation is None or layout is None:
            return StateRead(None, None, (), 0, 0, "")
        name = _state_name(s.generation, group)
        path = self.root / name
        dfd = open_dir(self.root)
        try:
            opened = open_file(dfd, self.root, name, direct=True)
        finally:
            os.close(dfd)
        if opened is None:
            raise StoreFormatError(f"{path} is missing: the training directory is damaged; restore it or start again")
        fd, direct = opened
        end = max((e.offset + e.nbytes for e in layout), default=0)
        size = os.fstat(fd).st_size
        if size < end or size % ALIGN:  # written whole pages at a time (StepWriter.write_state)
            os.close(fd)
            raise StoreFormatError(f"{path} has {size} bytes, a state file of {end} bytes of data is written as whole pages: "
                                   "the training directory is damaged; restore it or start again")  # fmt: skip
        f = File(id=-1, path=path, fd=fd, direct=direct, size=size, unnamed=False, what="training state file")
        buf = aligned_host_buffer(size)
        try:
            future = engine.read(buf[:size], Slot(f, 0, size)) if size else IOFuture.completed(0)
        except BaseException:
            os.close(fd)
            raise
        return StateRead(future, buf, layout, end, s.state_xxh3.get(group, 0), str(path), fd)

    def verify(self, engine: Engine) -> tuple[int, int]:
        """Re-read the current step's weight groups and state files and check every checksum;
        ``(groups, state files)`` checked. Raises :class:`StoreCorruptError` naming the first that differs."""
        files = self.files()
        try:
            for g in self.manifest.groups:
                self.read_group(engine, files, g)
        finally:
            files.close()
        for name in self.current.states:
            self.read_state(engine, name)
        return len(self.manifest.groups), len(self.current.states)

    # -- writing ------------------------------------------------------------------------------
    def check_writable(self, state_per_weight_byte: float) -> None:
        """Refuse, before any step computes (and creating nothing), a training directory this process
        cannot write or whose drive lacks room for the next generation: every group's weights and
        ``state_per_weight_byte`` times as many bytes of optimizer state (the files of the
        generation it replaces count as room: they are unlinked first).

        Raises:
            ConfigError: the directory (or its nearest existing parent) is read-only or not
                ours to write, or the drive is too full; the message names it and the fix.
        """
        fix = "pass StreamedTrainer(..., state_dir=DIR) on a writable drive with room, or make the store's drive writable"
        where = Path(os.path.abspath(self.root))
        while not os.path.lexists(where) and where != where.parent:
            where = where.parent  # the directory the first step creates its path in: nothing is made here
        probe = f".gds_offload-write-probe-{os.getpid()}"
        try:
            dfd = open_dir(where) if where == Path(os.path.abspath(self.root)) else os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"StreamedTrainer cannot use its training directory {self.root}: {where}: {exc.strerror}; {fix}") from exc
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            os.close(fd)
            os.unlink(probe, dir_fd=dfd)
            st = os.fstatvfs(dfd)
        except OSError as exc:
            raise ConfigError(f"StreamedTrainer cannot write its steps into {self.root} ({where}: {exc.strerror}); {fix}") from exc
        finally:
            os.close(dfd)
        weights = sum(f.nbytes for f in self.manifest.files)
        need = int(weights * (1 + state_per_weight_byte))
        other = 0 if self.current.generation == 1 else 1  # the generation the next step rewrites
        room = st.f_bavail * st.f_frsize + sum(
            p.stat().st_size for p in self.root.glob(f"*-{other}.*.bin") if p.is_file() and not p.is_symlink()
        )
        if room < need:
            gib = 1 << 30
            raise ConfigError(
                f"StreamedTrainer needs {need / gib:.2f} GiB free in {self.root} for a step's generation (the weights, "
                f"{weights / gib:.2f} GiB, and {state_per_weight_byte:g}x as much optimizer state), and its drive has "
                f"{room / gib:.2f} GiB; free room there, or {fix}"
            )

    def begin(self, engine: Engine) -> StepWriter:
        """Start writing step ``current.step + 1`` into the other generation."""
        make_dirs(self.root)
        g = 1 if self.current.generation == 0 else 0
        return StepWriter(self, engine, g)

    def commit(self, writer: StepWriter) -> Step:
        """Make ``writer``'s step the current one (see the module doc)."""
        step = writer.finish()
        data = {"format": _FORMAT, "step": step.step, "generation": step.generation,
                "groups": {k: f"{v:016x}" for k, v in step.groups.items()},
                "states": {k: [asdict(e) for e in v] for k, v in step.states.items()},
                "state_xxh3": {k: f"{v:016x}" for k, v in step.state_xxh3.items()}}  # fmt: skip
        dfd = open_dir(self.root)
        try:
            _unlink(dfd, STEP_NAME + ".partial")
            write_small_file(dfd, self.root, STEP_NAME, (json.dumps(data, indent=1) + "\n").encode())
            os.fsync(dfd)  # the rename itself
        finally:
            os.close(dfd)
        self.current = step
        return step

    # -- helpers ------------------------------------------------------------------------------
    def _generation_manifest(self, g: int) -> Manifest:
        files = [FileEntry(_weights_name(g, i), 0, f.nbytes) for i, f in enumerate(self.manifest.files)]
        return replace(self.manifest, files=files, dirs=[str(self.root)])

    def _read_step(self) -> Step:
        dfd = open_dir(self.root)
        try:
            data = read_file(dfd, self.root, STEP_NAME, limit=_STEP_LIMIT)
        finally:
            os.close(dfd)
        if data is None:
            return Step()
        where = self.root / STEP_NAME
        try:
            d = json.loads(data)
            if d.get("format") != _FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            names = {g.name for g in self.manifest.groups}
            groups = {str(k): int(v, 16) for k, v in d["groups"].items()}
            states = {str(k): tuple(StateEntry(str(e["param"]), str(e["key"]), str(e["dtype"]), tuple(int(x) for x in e["shape"]),
                                               int(e["offset"]), int(e["nbytes"])) for e in v) for k, v in d["states"].items()}  # fmt: skip
            xxh = {str(k): int(v, 16) for k, v in d["state_xxh3"].items()}
            step, gen = d["step"], d["generation"]
            if not (isinstance(step, int) and step >= 1 and gen in (0, 1)) or set(groups) != names or not set(states) <= names | {"resident"}:
                raise ValueError("its step, generation or groups are not this store's")
            for v in states.values():
                for e in v:
                    if e.dtype not in DTYPE_SIZES or e.offset < 0 or e.nbytes != math.prod(e.shape) * DTYPE_SIZES[e.dtype]:
                        raise ValueError(f"state {e.param}/{e.key}: bad dtype, offset or size")
            for k in states:
                check_name(_state_name(gen, k), where=str(where))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StoreFormatError(f"{where} is not a training step of this store ({exc}); remove {self.root} to start again from the store") from exc
        return Step(step, gen, groups, states, xxh)


class StepWriter:
    """The files of one step being written (:meth:`Generations.begin`); every write is checked at :meth:`finish`."""

    def __init__(self, gens: Generations, engine: Engine, generation: int) -> None:
        self._gens, self._engine, self.generation = gens, engine, generation
        self._groups: dict[str, int] = {}
        self._states: dict[str, tuple[StateEntry, ...]] = {}
        self._state_xxh3: dict[str, int] = {}
        self._pending: list[tuple[IOFuture, torch.Tensor]] = []
        self._files: list[File] = []
        root = gens.root
        dfd = open_dir(root)
        try:
            for name in os.listdir(dfd):  # the generation being replaced, and anything a kill left half-written
                if name.startswith((f"weights-{generation}.", f"state-{generation}.")) or name.endswith(".partial"):
                    _unlink(dfd, name)
            for i, f in enumerate(gens.manifest.files):
                fd, direct = create_file(dfd, _weights_name(generation, i), direct=True)
                self._files.append(File(id=i, path=root / _weights_name(generation, i), fd=fd, direct=direct, note="", size=f.nbytes,
                                        unnamed=False, what="training weight file"))  # fmt: skip
                if f.nbytes:
                    os.posix_fallocate(fd, 0, f.nbytes)  # a drive too small fails here
        except BaseException:
            self.close()
            raise
        finally:
            os.close(dfd)

    def write_group(self, group: GroupEntry, buf: torch.Tensor) -> None:
        """Write ``group``'s new bytes (``buf[:group.nbytes]``, a page-aligned buffer of its padded size)."""
        self._groups[group.name] = checksum(buf[: group.nbytes])
        slot = Slot(self._files[group.file], group.offset, group.padded_nbytes)
        self._pending.append((self._engine.write(buf[: group.padded_nbytes], slot), buf))
        self._settle()

    def write_state(self, group: str, entries: list[tuple[str, str, torch.Tensor]], *, read: StateRead | None = None) -> None:
        """Write the optimizer state of ``group``'s parameters (``(param, key, tensor)``): from the
        buffer of ``read`` (the state read for this update) when it :meth:`~StateRead.holds` them, else packed anew."""
        if read is not None and read.buf is not None and read.holds(entries):
            layout, buf, nbytes = read.layout, read.buf, read.end
        else:
            layout, buf, nbytes = pack_state(entries)
        self._states[group], self._state_xxh3[group] = layout, checksum(buf[:nbytes])
        dfd = open_dir(self._gens.root)
        try:
            fd, direct = create_file(dfd, _state_name(self.generation, group), direct=True)
        finally:
            os.close(dfd)
        f = File(id=len(self._files), path=self._gens.root / _state_name(self.generation, group), fd=fd, direct=direct, note="",
                 size=buf.numel(), unnamed=False, what="training state file")  # fmt: skip
        self._files.append(f)
        self._pending.append((self._engine.write(buf, Slot(f, 0, buf.numel())), buf))
        self._settle()

    def _settle(self) -> None:
        # A few writes in flight at most: each holds its buffer (a layer's bytes) until it is done.
        while len(self._pending) > _IN_FLIGHT:
            self._pending.pop(0)[0].wait()

    def finish(self) -> Step:
        """Wait for every write, fsync every file; the step they make."""
        for future, _ in self._pending:
            future.wait()
        self._pending.clear()
        for f in self._files:
            os.fsync(f.fd)
        self.close()
        missing = {g.name for g in self._gens.manifest.groups} - set(self._groups)
        assert not missing, f"a step must write every group; not written: {sorted(missing)}"
        return Step(self._gens.current.step + 1, self.generation, dict(self._groups), dict(self._states), dict(self._state_xxh3))

    def close(self) -> None:
        """Wait for the writes in flight and close the files (an abandoned step: nothing names it)."""
        for future, _ in self._pending:
            try:
                future.wait()
            except Exception:  # noqa: BLE001, S110 - abandoned: the step is never committed
                pass
        self._pending.clear()
        for f in self._files:
            close_fd(f)


_IN_FLIGHT = 4

def _weights_name(g: int, i: int) -> str:
    return f"weights-{g}.{i}.bin"


def _state_name(g: int, group: str) -> str:
    return f"state-{g}.{group}.bin"


def _unlink(dfd: int, name: str) -> None:
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass
