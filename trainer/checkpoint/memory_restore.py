"""The memory tier's restore: the collective plan of which step every rank restores from
memory (its own copy or its partner's), the transfer of a partner's copy, and the load.

``memory.MemoryTier`` mixes this in; the attributes it reads (``slots``, ``rank``,
``world_size``, ``ppn``, ``holder``, ``held``, ``partnered``, ``group``, ``trust``, the job's
identity) are the tier's, set in its constructor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint import memory_format as mf
from trainer.checkpoint.memory_load import load_copy
from trainer.checkpoint.memory_slots import Copy, Pinned, digest_of


@dataclass
class Plan:
    """The collective decision of a restore (the same on every rank)."""

    use: bool
    step: int | None
    reason: str
    partner_ranks: list[int] = field(default_factory=list)  # ranks restored from a partner
    data: memoryview | None = None  # this rank's verified bytes (use only)
    manifest: mf.MemoryManifest | None = None
    verify_s: float = 0.0
    durable_step: int | None = None  # the durable tier's newest committed step
    slot: str | None = None  # this rank's own slot holding the copy
    # The digest of this rank's own copy is still being computed ahead (``DigestAhead``):
    # ``load`` waits for it and compares before it copies, so the model is built meanwhile.
    digest_pending: bool = False
    # Wall-clock ends of the plan's parts (listed, gathered, verified, transferred) and of
    # the digests computed ahead: where a restore's wait goes, on the recovery's time line.
    at: dict[str, float] = field(default_factory=dict)


class MemoryRestore:
    """The restoring half of ``memory.MemoryTier`` (see the module)."""

    slots: Any
    rank: int
    world_size: int
    ppn: int
    holder: int
    held: int
    partnered: bool
    group: Any
    job: str
    config_hash: str | None
    pin_restore: bool
    device_type: str
    last_copy_s: float
    last_step: int | None
    _ahead: Any

    trust: Any  # signing.Trust | None
    _target: Any  # MemoryTier._target: the slot a save or a received copy goes to

    def _candidates(self, max_step: int | None) -> tuple[dict[int, Copy], dict[int, Copy],
                                                         list[str]]:
        """My own and my held partner's committed copies by step (<= max_step), and notes
        on the ones passed over."""
        notes: list[str] = []

        def usable(kind: str, rank: int) -> dict[int, Copy]:
            out: dict[int, Copy] = {}
            for slot in mf.SLOTS:
                m = self.slots.read_manifest(kind, rank, slot)
                if isinstance(m, str):
                    if m != "no committed copy":
                        notes.append(f"{kind} r{rank}/{slot}: {m}")
                    continue
                if max_step is not None and m.step > max_step:
                    notes.append(f"{kind} r{rank}/{slot}: step {m.step} > max {max_step}")
                    continue
                out[m.step] = Copy(kind, slot, m)
            return out

        own = usable("own", self.rank)
        held = usable("partner", self.held) if self.partnered else {}
        return own, held, notes

    def _verify(self, copy: Copy, rank: int, defer: bool = False
                ) -> tuple[memoryview | None, str | None]:
        """The copy's bytes, or why they do not verify. With ``defer`` (this rank's own copy,
        its digest computed ahead), the manifest is checked and the digest left to
        :meth:`load`."""
        buf = self.slots.map(copy.kind, rank, copy.slot)
        if buf is None:
            return None, "its slot is gone"
        problem = mf.check(copy.manifest, trust=self.trust, job=self.job,
                           config_hash=self.config_hash, rank=rank,
                           world_size=self.world_size, capacity=len(buf))
        if problem is None and not defer:
            ahead = self._ahead if copy.kind == "own" and rank == self.rank else None
            digest = ahead.digest(copy.slot, copy.manifest) if ahead is not None else None
            if (digest or digest_of(buf, copy.manifest)) != copy.manifest.digest:
                problem = "digest mismatch (torn or corrupt bytes)"
        return (memoryview(buf), None) if problem is None else (None, problem)

    def _digest_checked(self, plan: Plan) -> None:
        """The deferred digest of the planned copy (``Plan.digest_pending``): waits for the
        one computed ahead (or computes it) and raises ValueError when it differs."""
        assert plan.data is not None and plan.manifest is not None and plan.slot is not None
        t0 = time.perf_counter()
        digest = self._ahead.digest(plan.slot, plan.manifest) if self._ahead else None
        if (digest or digest_of(plan.data, plan.manifest)) != plan.manifest.digest:
            raise ValueError("digest mismatch (torn or corrupt bytes)")
        plan.digest_pending = False
        plan.verify_s += time.perf_counter() - t0
        plan.at["digest_checked"] = time.time()

    def plan(self, durable_step: int | None, max_step: int | None) -> Plan:
        """Collective over the group: whether (and from which step) every rank restores
        from memory, and this rank's verified bytes. Durable ``None``: no checkpoint."""
        t0 = time.perf_counter()
        at: dict[str, float] = {}
        own, held, notes = self._candidates(max_step)
        at["plan_listed"] = time.time()
        mine = {"own": sorted(own), "held": sorted(held), "notes": notes[:8]}
        every: list[Any] = [mine]
        if self.group is not None and self.world_size > 1:
            every = [None] * self.world_size
            dist.all_gather_object(every, mine, group=self.group)
        at["plan_gathered"] = time.time()
        plan = self._decide(every, own, held, durable_step, t0)
        plan.at = {**at, **plan.at, **dict(getattr(self._ahead, "marks", None) or {})}
        return plan

    def _decide(self, every: list[Any], own: dict[int, Copy], held: dict[int, Copy],
                durable_step: int | None, t0: float) -> Plan:
        """The plan's choice from every rank's candidates, then the verification and the
        partners' transfers it needs (collective)."""
        floor = -1 if durable_step is None else durable_step
        sources: dict[int, list[int]] = {}  # step -> ranks that need their partner
        steps = sorted({s for e in every for s in e["own"]} |
                       {s for e in every for s in e["held"]}, reverse=True)
        chosen = None
        for s in steps:
            if s < floor:
                break
            need: list[int] = []
            for r in range(self.world_size):
                if s in every[r]["own"]:
                    continue
                holder = (r + self.ppn) % self.world_size if self.partnered else None
                if holder is not None and s in every[holder]["held"]:
                    need.append(r)
                else:
                    need = None  # type: ignore[assignment]
                    break
            if need is not None:
                chosen, sources[s] = s, need
                break
        if chosen is None:
            why = "no memory copy" if not steps else (
                f"no step held by every rank at or after the durable step {durable_step}"
                f" (memory holds {steps[:4]})")
            extra = [n for e in every for n in e["notes"]][:4]
            return Plan(False, None, why + (f"; {'; '.join(extra)}" if extra else ""),
                        verify_s=time.perf_counter() - t0)
        need = sources[chosen]
        data, manifest, problem = None, None, None
        at: dict[str, float] = {}
        # Without a partner nothing else needs this rank's verdict before the load: its
        # own copy's digest (computed ahead from the process's start) is compared there,
        # after the model is built, and a mismatch loads the durable tier on every rank.
        # With one, a rank whose own copy fails takes its partner's here.
        defer = self.rank not in need and not self.partnered and self._ahead is not None
        if self.rank not in need:
            data, problem = self._verify(own[chosen], self.rank, defer=defer)
            manifest = own[chosen].manifest
            at["plan_verified"] = time.time()
        if self.rank in need:
            problem = "not received"
        data, manifest, problem, problems = self._transfer(need, chosen, held, data, manifest,
                                                           problem)
        at["plan_transferred"] = time.time()
        # A rank whose own copy fails (torn, bit-rot) takes its partner's, when it has one.
        retry = [r for r, p in enumerate(problems) if p and r not in need and self.partnered
                 and chosen in every[(r + self.ppn) % self.world_size]["held"]]
        passed = [f"rank {r}'s own copy: {problems[r]}" for r in retry]
        if retry:
            data, manifest, problem, problems = self._transfer(retry, chosen, held, data,
                                                               manifest, problem)
            need = sorted(need + retry)
        if any(problems):
            bad = [f"rank {r}: {p}" for r, p in enumerate(problems) if p][:4]
            return Plan(False, chosen, f"the step {chosen} copy fails verification: "
                        + "; ".join(passed + bad), verify_s=time.perf_counter() - t0)
        how = f"step {chosen} held by every rank" + (
            f", ranks {need} from their partner's copy" if need else "")
        if passed:
            how += " (" + "; ".join(passed[:4]) + ")"
        if durable_step is not None:
            how += f" (durable tier: step {durable_step})"
        slot = next((c.slot for c in self.slots.copies("own", self.rank)
                     if c.manifest.step == chosen), None)
        return Plan(True, chosen, how, need, data, manifest, time.perf_counter() - t0,
                    slot=slot, at=at, digest_pending=defer)

    def _transfer(self, need: list[int], step: int, held: dict[int, Copy], data: Any,
                  manifest: Any, problem: str | None) -> tuple[Any, Any, str | None, list]:
        """Holders verify and send the copies of the ranks in ``need`` (sends are
        asynchronous: a rank may hold one and receive one at once); those ranks receive
        and verify theirs. Then every rank learns every rank's problem (None: fine)."""
        sends: list[Any] = []
        if self.partnered and self.held in need:
            hdata, hproblem = self._verify(held[step], self.held)
            sends = self._send_copy(held[step], hdata, hproblem)
        if self.rank in need:
            data, manifest, problem = self._receive_copy(step)
        for work in sends:
            work.wait()
        problems: list[Any] = [problem]
        if self.group is not None and self.world_size > 1:
            problems = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=self.group)
        return data, manifest, problem, problems

    def _send_copy(self, copy: Copy, data: memoryview | None,
                   problem: str | None) -> list[Any]:
        """Start sending the held copy (its signed manifest, then its bytes) to the rank
        it belongs to; an empty header says it failed verification here."""
        raw = self.slots.path(copy.kind, self.held, copy.slot, "json").read_bytes() \
            if problem is None else b""
        header = torch.tensor([len(raw), copy.manifest.data_bytes if problem is None else 0],
                              dtype=torch.int64)
        works = [dist.isend(header, self.held, group=self.group)]
        if problem is None and data is not None:
            works.append(dist.isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8),
                                    self.held, group=self.group))
            works.append(dist.isend(torch.frombuffer(data, dtype=torch.uint8,
                                                     count=copy.manifest.data_bytes),
                                    self.held, group=self.group))
        return works

    def _receive_copy(self, step: int) -> tuple[memoryview | None, Any, str | None]:
        """Receive my copy from my holder into my older own slot, commit and verify it."""
        header = torch.zeros(2, dtype=torch.int64)
        dist.recv(header, self.holder, group=self.group)
        m_len, d_len = int(header[0]), int(header[1])
        if m_len == 0:
            return None, None, f"my partner's copy (rank {self.holder}) fails verification"
        raw = torch.zeros(m_len, dtype=torch.uint8)
        dist.recv(raw, self.holder, group=self.group)
        slot = self._target("own", self.rank)
        buf = self.slots.map("own", self.rank, slot)
        scratch = torch.zeros(d_len, dtype=torch.uint8) if buf is None or d_len > len(buf) \
            else torch.frombuffer(buf, dtype=torch.uint8, count=d_len)
        if buf is not None:
            self.slots.uncommit("own", self.rank, slot)
        dist.recv(scratch, self.holder, group=self.group)
        if buf is None or d_len > len(buf):
            return None, None, "no own slot to receive my partner's copy into"
        try:
            manifest = mf.parse_manifest(raw.numpy().tobytes())
        except ValueError as exc:
            return None, None, f"partner's manifest: {exc}"
        if manifest.step != step:
            return None, None, f"partner sent step {manifest.step}, not {step}"
        self.slots.commit("own", self.rank, slot, raw.numpy().tobytes())
        data, problem = self._verify(Copy("own", slot, manifest), self.rank)
        return data, manifest, problem

    def _device_copy(self, slot: str | None) -> Callable[[list[Any]], None] | None:
        """Who makes a restore's host-to-device copies when not this process (None: it
        does)."""
        return None

    def load(self, plan: Plan, state: dict[str, Any]) -> None:
        """Copy the planned copy into ``state`` (``memory_load.load_copy``). Raises
        ValueError when it does not load; the copy is then uncommitted, so no restart
        picks it again (the next one takes the partner's copy or the durable tier)."""
        assert plan.use and plan.data is not None and plan.manifest is not None
        device_copy = self._device_copy(plan.slot)
        buf = self.slots.map("own", self.rank, plan.slot) if self.pin_restore and \
            plan.slot is not None and device_copy is None else None
        try:
            if plan.digest_pending:
                self._digest_checked(plan)
            self.last_copy_s = load_copy(plan.data, plan.manifest, state,
                                         pin=Pinned(buf, plan.manifest.data_bytes)
                                         if buf is not None else None,
                                         cuda=self.device_type == "cuda", marks=plan.at,
                                         device_copy=device_copy)
        except Exception as exc:  # noqa: BLE001 - any failure: this copy never loads
            if plan.slot is not None:
                self.slots.uncommit("own", self.rank, plan.slot)
            raise ValueError(f"the step {plan.step} memory copy does not load (uncommitted):"
                             f" {type(exc).__name__}: {str(exc)[:300]}") from None
        self.last_step = plan.step
