"""Object-store checkpoints inside the training loop (checkpoint.in_memory: true).

Every checkpoint step, each rank has DeepSpeed build its state dicts (deepspeed_io.capture) and goes
on training while they are copied into the object store (on the CPU straight from the live
tensors: one memcpy per tensor, no serialisation; the loop calls fence() before the next optimizer
step) and a background thread hands them to its node's keeper (handoff.py). The keeper copies,
replicates and persists in the background (only persisting writes DeepSpeed's files). A restore
from memory at the same world size serves the state dicts to DeepSpeed from the object store
(deepspeed_io.ServeEngine): no file is written or read. Rank 0 reports a small *pointer*
checkpoint to Ray Train ({run, step, world_size, persist_url, complete_step, resumed_from,
earlier}), so Ray Train's bookkeeping, get_checkpoint() and Tune keep working. The pointer is
reported before the ranks' parts of `step` have reached their keepers, so it is only a hint:
restore loads the newest step that is complete, whatever the pointer says. `complete_step` is
the newest step every rank had handed over when the pointer was written (None before the first):
the one the pointer vouches for. Each save agrees on it with one MIN all-reduce over the steps
since the last agreed one, each rank saying which of them its keeper holds or persist_url has
(not each rank's newest step: a rank that lost step s, and whose later handoff succeeded, would
vouch for s). Each part's meta keeps the loop's client state with only its own rank's entry
(data position, RNG), so a part's meta stays the same size at any world size (every rank's in
every part made the keepers' inventories grow as its square); a restore gathers every rank's entry
by one all-gather of the parts' own entries (another layout fetches every part anyway). Parts of
older checkpoints, each carrying every rank's, load as saved. `resumed_from` ({run,
persist_url, step}) is what this fit's latest restore loaded (carried over from the pointer when
it loaded nothing), so a fit that fails before its own first snapshot is complete can resume
from there again. `earlier` lists the run's earlier fits whose persisted steps this one may
supersede (see below).

Restoring after a restart, every rank must load the same step, so the choice is collective: rank 0
lists the complete steps (newest first) and broadcasts them: those complete in the keepers' memory
and at persist_url alike (listed while the keepers are asked), as a newer step may be persisted
only (a snapshot the object store refused, or whose memory copies were lost); for each, every rank
fetches what it needs from the fastest copy (memory, for a step that is in both), and the step is
loaded only if all ranks succeeded (else a warning and the previous one). Saving involves no
collective beyond DeepSpeed's own: a snapshot the object store cannot take is written to
persist_url by its rank alone (handoff.py), so no rank ever waits in a collective that another
skipped.

Run keys: `<name>-<hash of the run dir>-<fit>`, one per TorchTrainer.fit. A restarted worker group
of the same fit first looks at its own key: Ray Train registers a reported checkpoint only when its
controller next polls the workers, so a worker killed right after a save can leave the pointer one
checkpoint behind (or absent) while the snapshot itself is complete in the keepers. Failing that,
a new fit resumes from the key named by Ray Train's pointer (the previous fit's), and with neither
it starts afresh. Leftovers of earlier fits in the same run directory are never read; they are
freed once this fit has a complete snapshot of its own (until then a restart may need the step it
resumed from). A pointer (of this fit or a previous one) that vouches for no step (its fit died
before every rank had handed over a snapshot) leads to the step its fit resumed from
(resumed_from), or, with none, to a fresh start with a warning; a pointer whose complete_step or
resumed_from survives nowhere is an error (training would silently be lost).

The earlier fits' persisted steps are the run's too: `keep_persisted` counts the newest complete
steps at persist_url over all of its fits. Once this fit has persisted a step, close() removes
from the earlier fits (the pointer's, the one it resumed from, and the `earlier` they superseded
in turn: at most keep_persisted + 1, newest first) every step older than those, and an incomplete
one older than this fit's newest; an earlier fit goes once nothing of it is left. Only fits of
this run directory at this fit's persist_url are touched: never another run's keys (a copy of a
run directory resumes from the original's, which must not lose its checkpoints), nor another
persist_url.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from typing import Any

from raylib.checkpoint import deepspeed_io
from raylib.checkpoint.capture import Flat, HostCopy
from raylib.checkpoint.handoff import Handoff
from raylib.checkpoint.keeper import StorePolicy, live_keepers
from raylib.checkpoint.store import SOURCES, CheckpointStore, first_usable

log = logging.getLogger(__name__)

POINTER = "raylib-checkpoint.json"
MAX_PENDING = 2  # snapshots on their way to a keeper at once (each a host copy held by this rank)


def read_pointer(checkpoint) -> dict[str, Any] | None:
    """The pointer in a Ray Train checkpoint (None: none, or a DeepSpeed checkpoint directory)."""
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        path = os.path.join(directory, POINTER)
        if not os.path.isfile(path):
            return None
        with open(path) as f:
            return json.load(f)


def run_family(spec, run_dir: str) -> str:
    """The prefix of the run keys of every fit of one run directory."""
    return f"{spec.name}-{hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]}-"


def newest_held_run(family: str) -> str | None:
    """The run key (of the fits of `family`) whose parts the keepers hold the newest step of."""
    import ray

    from raylib.checkpoint.keeper import live_keepers
    from raylib.checkpoint.store import QUERY_TIMEOUT_S

    newest: tuple[int, str] | None = None
    for keeper in live_keepers().values():
        try:
            parts = ray.get(keeper.inventory.remote(), timeout=QUERY_TIMEOUT_S)
        except ray.exceptions.RayError:
            continue
        for p in parts:
            if p["run"].startswith(family) and (newest is None or p["step"] > newest[0]):
                newest = (p["step"], p["run"])
    return newest[1] if newest else None


def fit_id() -> str:
    """The same in every worker-group attempt of one TorchTrainer.fit, new for the next fit."""
    import ray

    try:  # Train V2 keeps one run id per fit in its (developer-level) train run context
        from ray.train.v2._internal.execution.context import get_train_context

        return get_train_context().train_run_context.run_id[:12]
    except (ImportError, AttributeError, RuntimeError):  # outside Train V2: the driver's job is the scope
        return ray.get_runtime_context().get_job_id()


def _connect_to_keepers(rank: int) -> None:
    """Resolve the keepers and open a connection (what restore's first query would wait for): rank
    0 to every keeper (it lists what they hold), the others to their own node's (they fetch there)."""
    import ray

    try:
        keepers = live_keepers()
        if rank != 0:
            keepers = {n: k for n, k in keepers.items() if n == ray.get_runtime_context().get_node_id()}
        ray.get([k.inventory.remote("") for k in keepers.values()], timeout=30)
    except Exception:  # only a warm-up: restore handles dead or missing keepers itself
        pass


def policy_of(spec, run_dir: str) -> StorePolicy:
    c = spec.checkpoint
    return StorePolicy(
        persist_url=c.persist_url or os.path.join(run_dir, "checkpoints"),
        storage_options=dict(c.storage_options), keep_in_memory=c.keep_in_memory,
        keep_persisted=c.keep_persisted, replicas=c.replicas, max_store_fraction=c.max_store_fraction,
    )


class ObjectStoreCheckpointer:
    def __init__(self, spec, run_dir: str):
        import torch.distributed as dist

        self.spec = spec
        self.policy = policy_of(spec, run_dir)
        self.family = run_family(spec, run_dir)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp = spec.strategy.tensor_parallel
        self.pp = spec.strategy.pipeline_parallel
        self.store: CheckpointStore | None = None
        self._blocked: list[float] = []
        self._bytes = 0
        self._refused: list[str] = []
        self._replicas: list[str] | None = None
        self._restored: dict[str, Any] = {"restore_source": None, "restore_s": None, "restored_step": None,
                                          "restored_from": None, "restore_phases_s": None}
        self._flushed: dict[str, Any] = {}
        self._pending: list[Handoff] = []  # snapshots the keeper has not answered for yet
        self._device = None
        self._phases: dict[str, float] = {}
        self._copy: HostCopy | None = None  # the newest snapshot's host copy, until fenced
        self._unpersisted: int | None = None  # the newest snapshot's step if put without persistence
        self._saved: list[int] = []  # the newest steps snapshotted since `_agreed` (the same on every rank)
        self._held: set[int] = set()  # of those, the ones whose part a keeper or persist_url has
        self._agreed: int | None = None  # the newest step whose part every rank has handed over
        self._last_persist = time.monotonic()  # rank 0's: a duration cadence counts from the start
        self._resumed_from: dict[str, Any] | None = None  # what restore loaded (run, persist_url, step)
        self._earlier: list[str] = []  # earlier fits of this run whose persisted steps close() trims
        self._others_dropped = False  # whether other fits' memory copies were freed (rank 0)
        if spec.checkpoint.in_memory:  # while the engine is built: a first actor call costs ~0.1 s
            threading.Thread(target=_connect_to_keepers, args=(self.rank,), name="ckpt-connect",
                             daemon=True).start()

    # -- collectives ----------------------------------------------------------------------------

    def _reduce(self, device, values: list[float], op: str) -> list[float]:
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        return t.tolist()

    def _from_rank0(self, value):
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- restore --------------------------------------------------------------------------------

    def restore(self, engine, pointer: dict[str, Any] | None) -> tuple[int, dict[str, Any]] | None:
        """Load the newest complete checkpoint of this fit, else of the fit the pointer names, else
        (when the pointer vouches for no step) of the one it resumed from: (next step, state); None
        when there is none (a fresh start)."""
        t0 = time.perf_counter()
        self.store = CheckpointStore(self.family + fit_id(), self.policy)
        self._earlier = self._earlier_fits(pointer)
        readers = [self.store]
        # pointers written before complete_step existed vouch for their step
        vouched = pointer.get("complete_step", pointer["step"]) if pointer is not None else None
        ours = pointer is not None and pointer["run"] == self.store.run
        # a pointer that vouches for nothing (its fit had no complete snapshot of its own yet) falls
        # back to what that fit resumed from; one that vouches for a step must find it (an older
        # fit's step would silently drop the training done since)
        lineage = pointer.get("resumed_from") if pointer is not None and vouched is None else None
        others = [(pointer["run"], pointer["persist_url"])] if pointer is not None else []
        others += [(lineage["run"], lineage["persist_url"])] if lineage is not None else []
        for run, url in dict.fromkeys(others):
            if run != self.store.run:
                readers.append(CheckpointStore(run, replace(self.policy, persist_url=url)))
        # Each reader's complete steps in the keepers' memory or at persist_url, newest first: the
        # newest wins wherever it is (of one step, the memory copy is fetched). A run may have a
        # newer step at persist_url only (refused by the keepers, or its memory copies lost), and
        # older fits' memory copies outlive this fit's restore (freed at its first complete
        # snapshot): a step held in memory says nothing of newer ones.
        found = None
        for reader in readers:
            with self._phase("restore_plan"):
                candidates = self._from_rank0(reader.complete_steps() if self.rank == 0 else None)
            if candidates and (found := self._load_newest(engine, reader, candidates)) is not None:
                self._restored = {"restore_source": found[2], "restored_step": found[0],
                                  "restore_s": time.perf_counter() - t0, "restored_from": reader.run,
                                  "restore_phases_s": {k: v for k, v in self._phases.items()
                                                       if k.startswith("restore_")}}
                break
        if found is not None:
            self._resumed_from = {"run": reader.run, "persist_url": reader.policy.persist_url,
                                  "step": found[0]}
            if reader is self.store:  # complete on every rank: pointers vouch for it, retention keeps it
                self._agreed = found[0]
        else:  # nothing loaded: a restart must still find what this fit resumed from
            self._resumed_from = lineage
        if found is None and lineage is not None:
            raise RuntimeError(
                f"Ray Train's latest checkpoint points to {pointer['run']} step {pointer['step']}, "
                f"which had no complete checkpoint of its own but resumed from {lineage['run']} step "
                f"{lineage['step']}; no complete copy of that step (or an earlier one) survives in the "
                f"keepers' memory or at {lineage['persist_url']}; restore the persisted files, or start "
                "the run afresh (remove its run directory)")
        if found is None and ours and vouched is None:
            log.warning("Ray Train's latest checkpoint points to step %d of this run, but no rank's "
                        "set of parts for it (or any earlier step) was complete when the worker group "
                        "failed: starting afresh", pointer["step"])
        elif found is None and pointer is not None and vouched is None:
            log.warning("Ray Train's latest checkpoint points to step %d of %s, which failed before "
                        "every rank had handed over any snapshot (none survives): starting afresh",
                        pointer["step"], pointer["run"])
        elif found is None and pointer is not None:
            raise RuntimeError(
                f"Ray Train's latest checkpoint points to {pointer['run']} step {pointer['step']} (step "
                f"{vouched} complete on every rank), but no complete copy of any checkpoint of that run "
                f"survives in the keepers' memory or at "
                f"{pointer['persist_url']}; restore the persisted files, or start the run afresh "
                "(remove its run directory)"
            )
        return found[:2] if found else None

    def _earlier_fits(self, pointer: dict[str, Any] | None) -> list[str]:
        """The run keys of the earlier fits of this run directory whose steps persisted at this
        fit's persist_url it may supersede, newest first: the pointer's fit, the one it resumed
        from, and the pointer's own `earlier`."""
        url = self.policy.persist_url
        if pointer is None or pointer.get("persist_url") != url:  # not what this fit manages
            return []
        lineage = pointer.get("resumed_from") or {}
        runs = [pointer["run"], *([lineage["run"]] if lineage.get("persist_url") == url else []),
                *(pointer.get("earlier") or [])]
        return [run for run in dict.fromkeys(runs)
                if run != self.store.run and run.startswith(self.family)][:self.policy.keep_persisted + 1]

    def _load_newest(self, engine, reader: CheckpointStore, candidates: list[tuple[int, int]]):
        """(step, state, source) of the newest candidate all ranks could fetch, loaded; or None."""
        scratch = deepspeed_io.scratch_dir(engine, "raylib-restore-")
        try:
            def fetch(step: int, saved_world: int):
                directory, memory = tempfile.mkdtemp(dir=scratch), {}
                with self._phase("restore_fetch"):
                    return (directory, memory, *self._fetch(reader, step, saved_world, directory, memory))

            def agree(ok: bool) -> bool:
                with self._phase("restore_agree"):
                    return bool(self._reduce(engine.device, [ok], "MIN")[0])

            found = first_usable(candidates, fetch, agree, reader.run)
            if found is None:
                return None
            step, saved_world, (directory, memory, state, source, every_rank) = found
            if not every_rank and "own" in state:  # the same on every rank: one checkpoint's format
                state = self._gather_own(state)
            with self._phase("restore_load"):
                self._load(engine, directory, step, every_rank, memory, saved_pp=int(state.get("pp", 1)),
                           saved_tp=int(state.get("tp", 1)))
                if not every_rank:  # at another layout a rank's own state has no owner here
                    state = {**state, "rank_state": deepspeed_io.read_rank_state(
                        directory, deepspeed_io.tag(step), self.rank, memory)}
            return step, state, source
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _gather_own(self, state: dict[str, Any]) -> dict[str, Any]:
        """A same-layout restore's client state: this rank's part keeps its own entry ("own"); the
        ranks' entries back in "ranks", by one all-gather (old rank r is rank r here)."""
        import torch.distributed as dist

        entries: list[Any] = [None] * dist.get_world_size()
        with self._phase("restore_agree"):
            dist.all_gather_object(entries, state["own"])
        return {**{k: v for k, v in state.items() if k != "own"}, "ranks": entries}

    def _fetch(self, reader: CheckpointStore, step: int, saved_world: int, directory: str,
               memory: dict[str, Any]) -> tuple[dict[str, Any], str, bool]:
        """Fetch what this rank loads into `directory`: (client state, source, whether it is every
        old rank's files). At the same layout (world size, tensor-parallel size) the state dicts
        the keepers hold go into `memory` instead (served to DeepSpeed from the object store)."""
        holders = reader.holders()
        if self._same_layout(reader, step, holders, saved_world):
            # own part, the weights the first replica wrote for everyone, and (tensor parallel)
            # the model files of every tp rank: DeepSpeed lists mp_rank_* and wants them all;
            # (pipeline) every stage's layer files, which the first replica's ranks wrote
            own = reader.fetch(step, self.rank, directory, holders=holders, memory=memory)
            sources = [own.source]
            group = self.rank - self.rank % self.tp
            for other, select in [(r, deepspeed_io.shared) for r in range(self.tp * self.pp)] + \
                    [(r, deepspeed_io.model_states) for r in range(group, group + self.tp)]:
                if other != self.rank:
                    sources.append(reader.fetch(step, other, directory, select, holders,
                                                memory=memory).source)
            # the other ranks' entries of the client state come by one all-gather once the step is
            # agreed (_load_newest): reading every part's meta on every rank is world^2 reads
            return dict(own.meta.get("state") or {}), max(sources, key=SOURCES.index), False
        # another layout: every old rank's files, for the universal conversion
        parts = [reader.fetch(step, r, directory, holders=holders) for r in range(saved_world)]
        return (_client_state(dict(enumerate(p.meta for p in parts)), saved_world),
                max((p.source for p in parts), key=SOURCES.index), True)

    def _same_layout(self, reader: CheckpointStore, step: int, holders: dict, saved_world: int) -> bool:
        """Whether step was saved with this run's world, tensor- and pipeline-parallel sizes (rank
        0's part says)."""
        state = (reader.peek_meta(step, 0, holders) or {}).get("state") or {}
        saved = (saved_world, int(state.get("tp", 1)), int(state.get("pp", 1)))
        return saved == (self.world, self.tp, self.pp)

    def _load(self, engine, directory: str, step: int, every_rank: bool,
              memory: dict[str, Any] | None = None, saved_pp: int = 1, saved_tp: int = 1) -> None:
        files = [os.path.relpath(os.path.join(r, n), directory)
                 for r, _, names in os.walk(directory) for n in names]
        if every_rank and (saved_pp > 1 or self.pp > 1):
            if not deepspeed_io.needs_universal(files):
                raise RuntimeError(
                    f"step {step} was saved at ZeRO-0 with pipeline_parallel={saved_pp}: without "
                    f"optimizer partitions DeepSpeed's universal conversion cannot change its layout "
                    f"(now pipeline_parallel={self.pp}, {self.world} workers); resume with the saved "
                    "layout, or export it (`raylib export`) and start a new run from the model")
            from raylib.train.pipeline import rename_universal

            log.warning("resuming step %d on another layout (pipeline_parallel %d -> %d, tensor_parallel "
                        "%d -> %d, %d ranks now): converting to a DeepSpeed universal checkpoint", step,
                        saved_pp, self.pp, saved_tp, self.tp, self.world)
            deepspeed_io.load_universal(engine, directory, step,
                                        rename=lambda zero: rename_universal(zero, engine.module, saved_pp))
            return
        if every_rank and _saved_tp(files) != self.tp and not deepspeed_io.needs_universal(files):
            raise RuntimeError(
                f"step {step} was saved at ZeRO-0 with tensor_parallel={_saved_tp(files)}: its "
                f"tensor-parallel shards carry no optimizer partitions for DeepSpeed's universal "
                f"conversion, so it resumes only at that layout (now tensor_parallel={self.tp}); "
                "resume with that layout, or train with zero_stage >= 1 to change layouts")
        if every_rank and (deepspeed_io.needs_universal(files) or _saved_tp(files) != self.tp):
            log.warning("resuming step %d on another layout (%d ranks, tensor_parallel=%d now; saved "
                        "with tensor_parallel=%d): converting to a DeepSpeed universal checkpoint",
                        step, self.world, self.tp, _saved_tp(files))
            deepspeed_io.load_universal(engine, directory, step)
        else:
            deepspeed_io.load(engine, directory, step, memory)

    # -- save -----------------------------------------------------------------------------------

    def save(self, engine, step: int, metrics: dict[str, Any], state: dict[str, Any],
             rank_state: dict[str, Any] | None = None) -> None:
        t0 = time.perf_counter()
        self._reap()
        self._device = engine.device
        with self._phase("agree"):  # what the pointer vouches for: the newest step all ranks handed over
            self._agree(engine.device)
        handed = -1 if self._agreed is None else self._agreed
        if handed >= 0 and self.rank == 0 and not self._others_dropped:
            # this fit has a complete snapshot: a restart no longer needs other fits' memory copies
            self.store.drop_others(self.family)
            self._others_dropped = True
        metrics = {**metrics, "checkpoint_complete_step": None if handed < 0 else handed}
        own = _part_state(state, self.rank, self.world)  # DeepSpeed's files get this rank's entry too
        with self._phase("capture"):
            captured = deepspeed_io.capture(engine, step, own, rank_state)
            self._bytes = sum(p.nbytes if isinstance(p, Flat) else len(p) for p in captured.values())
            persist = self._persist_due(step)
            self._unpersisted = None if persist else step
            handoff = Handoff(self.store, self.rank, self.world, step, captured, self._bytes,
                              {"state": own}, self._refused,
                              persist=persist, complete_step=None if handed < 0 else handed)
            # the copy thread puts the live tensors straight into the object store (CPU)
            handoff.copy = self._copy = HostCopy([p for p in captured.values() if isinstance(p, Flat)],
                                                 put=handoff.put_live)
        handoff.start()
        self._pending.append(handoff)
        self._saved.append(step)
        with self._phase("report"):
            self._report(metrics, step)
        self._blocked.append(time.perf_counter() - t0)

    def _agree(self, device) -> None:
        """Move `_agreed` on to the newest step since it whose part every rank holds (a keeper's
        copy, or persisted). A step's answer is final once its handoff settled on every rank: at
        the latest MAX_PENDING saves later (_reap), so only the steps of those saves are asked."""
        self._saved = [s for s in self._saved if self._agreed is None or s > self._agreed][-MAX_PENDING:]
        self._held &= set(self._saved)
        if not self._saved:  # (every rank's list is the same: each rank saves the same steps)
            return
        ok = self._reduce(device, [float(s in self._held) for s in self._saved], "MIN")
        self._agreed = max((s for s, o in zip(self._saved, ok, strict=True) if o), default=self._agreed)

    def _persist_due(self, step: int) -> bool:
        """Any snapshot off schedule (a preemption's), and on schedule every persist_every-th, or
        the first one persist_every (a duration) after the last persisted one: rank 0's clock
        decides for every rank (a step is persisted by all ranks or by none). The last of a run
        is persisted by close()."""
        c = self.spec.checkpoint
        every, interval = c.interval_steps, c.persist_interval_s
        if not every or step % every != 0:
            return True
        if interval is None:
            return c.persist_every == 1 or (step // every) % c.persist_every == 0
        due = self._from_rank0(time.monotonic() - self._last_persist >= interval)
        if due:
            self._last_persist = time.monotonic()
        return due

    def fence(self) -> None:
        """Call before the optimizer step (it writes to what the newest snapshot is copying). Its
        wait counts as blocked time; on a GPU the wait is the device's (a stream dependency)."""
        if self._copy is None:
            return
        t0 = time.perf_counter()
        with self._phase("fence"):
            self._copy.fence()
        self._copy = None
        self._blocked[-1] += time.perf_counter() - t0

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Time spent in `name`, summed (metrics: where the blocked and the restore time go)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + time.perf_counter() - t0

    def _reap(self, everything: bool = False) -> None:
        """Settle the handoffs that are done (every one with `everything`), and the oldest ones
        beyond MAX_PENDING: each holds a host copy of its snapshot (bounded memory)."""
        with self._phase("keeper_wait"):
            while self._pending and (everything or self._pending[0].done()
                                     or len(self._pending) >= MAX_PENDING):
                h = self._pending.pop(0)
                h.settle()
                if not h.lost:  # its keeper owns the part, or it was written to persist_url
                    self._held.add(h.step)
                self._replicas = h.replicas if h.replicas is not None else self._replicas

    def settle(self) -> None:
        """Wait until every snapshot taken is the keeper's (or written to persist_url)."""
        self._reap(everything=True)

    def _report(self, metrics: dict[str, Any], step: int) -> None:
        import ray.train

        if self.rank != 0:
            ray.train.report(metrics)
            return
        pointer = self._pointer(step, metrics["checkpoint_complete_step"])
        directory = tempfile.mkdtemp(prefix="raylib-pointer-")
        with open(os.path.join(directory, POINTER), "w") as f:
            json.dump(pointer, f)
        # uploaded in the background: a pointer Ray Train misses is found in the keepers anyway
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory),
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=True)

    def _pointer(self, step: int, complete_step: int | None) -> dict[str, Any]:
        return {"run": self.store.run, "step": step, "world_size": self.world,
                "persist_url": self.policy.persist_url, "complete_step": complete_step,
                "resumed_from": self._resumed_from, "earlier": self._earlier}

    def close(self) -> None:
        """Wait for background persistence, then free this rank's parts up to the newest persisted
        step from memory (a finished run's checkpoints stay at persist_url only). Once this fit
        has a checkpoint there, the earlier fits' persisted steps that the run's retention no
        longer keeps are removed (_supersede())."""
        if self.store is None or not self._blocked:
            return
        self.settle()
        if self._unpersisted is not None:  # a finished run's last snapshot must outlive the keepers
            self.store.persist_held(self._unpersisted, self.rank)
        self._bytes = int(self._reduce(self._device, [self._bytes], "SUM")[0])  # all ranks' parts
        self._flushed = self.store.flush()
        self._flushed["persisted"] = sorted(self.store.persisted.complete_steps())
        for error in self._flushed["errors"]:
            log.warning("checkpoint %s: %s", self.store.run, error)
        if self._flushed["persisted"]:  # superseded or safe on persist_url
            self.store.drop(rank=self.rank, upto=self._flushed["persisted"][-1])
            if self.rank == 0 and not self._others_dropped:  # no save saw a complete step: free them now
                self.store.drop_others(self.family)
        if self.rank == 0 and self._flushed["persisted"] and self._earlier:
            try:
                self._supersede()
            except Exception as e:  # only a clean-up: what it leaves is kept, not lost
                log.warning("checkpoint %s: could not remove the earlier fits' superseded persisted "
                            "steps: %s", self.store.run, e)

    def _supersede(self) -> None:
        """Apply keep_persisted to the run's fits together: of the earlier fits' persisted steps,
        remove those older than the keep_persisted newest complete steps (this fit's persisted
        ones included), and an incomplete one older than this fit's newest persisted step (it
        can never be completed); an earlier fit with nothing left goes."""
        mine = self._flushed["persisted"]  # this fit's complete persisted steps, oldest first
        earlier = [CheckpointStore(run, self.policy).persisted for run in self._earlier]
        steps = [(run, run.steps()) for run in earlier]
        complete = sorted({*mine, *(s for _, found in steps for s, (world, ranks) in found.items()
                                    if ranks >= set(range(world)))}, reverse=True)
        keep = self.policy.keep_persisted
        cut = complete[keep - 1] if len(complete) >= keep else None
        for run, found in steps:
            for step, (world, ranks) in sorted(found.items()):
                if (cut is not None and step < cut) or (step < mine[-1] and not ranks >= set(range(world))):
                    run.remove_step(step)
            if not run.parts():
                run.remove_all()

    @property
    def blocked_s(self) -> list[float]:
        """Seconds each save held training up (DeepSpeed building its state dicts, waiting for older
        handoffs, and at the fence the part of the host copy the next forward/backward did not hide)."""
        return list(self._blocked)

    def metrics(self) -> dict[str, Any]:
        b = self._blocked
        if self._replicas is None:
            replicas = None
        elif self._replicas:
            replicas = len(self._replicas)
        else:
            replicas = "none (checkpoint.replicas: 0)" if not self.policy.replicas else "none (one node)"
        return {
            "mode": "memory", "snapshots": len(b),
            "blocked_s_mean": sum(b) / len(b) if b else None, "blocked_s_max": max(b, default=None),
            "blocked_phases_s_mean": {k: v / len(b) for k, v in self._phases.items()
                                      if not k.startswith("restore_")} if b else None,
            "bytes_per_snapshot": self._bytes, "replicas": replicas, "refused": len(self._refused),
            "refused_first": self._refused[0] if self._refused else None,
            "persist_url": self.policy.persist_url,
            "persisted_steps": self._flushed.get("persisted"),
            "persist_errors": self._flushed.get("errors"),
            "run": self.store.run if self.store else None,
            **self._restored,
        }


def _part_state(state: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """What a part's meta keeps of the loop's client state: of its per-rank entries ("ranks", one
    per rank), this rank's own ("own"); every rank's in every part grew as world size squared."""
    ranks = state.get("ranks")
    if not isinstance(ranks, list) or len(ranks) != world:
        return state
    return {**{k: v for k, v in state.items() if k != "ranks"}, "own": ranks[rank]}


def _client_state(metas: dict[int, dict[str, Any]], world: int) -> dict[str, Any]:
    """The loop's client state from the metas of a step's parts ({old rank: meta}): each part's own
    entry back at its rank in "ranks" (None for a part not given); a part of an older checkpoint
    carries every rank's and is returned as saved."""
    states = {r: m.get("state") or {} for r, m in metas.items()}
    first = next(iter(states.values()))
    if "own" not in first:
        return dict(first)
    return {**{k: v for k, v in first.items() if k != "own"},
            "ranks": [states[r].get("own") if r in states else None for r in range(world)]}


def _saved_tp(files: list[str]) -> int:
    """The tensor-parallel size a DeepSpeed checkpoint was saved with (its mp_rank_XX files)."""
    ranks = {int(m.group(1)) for f in files if (m := re.search(r"mp_rank_(\d+)", f))}
    return max(ranks, default=0) + 1
