"""The memory tier's GPU copies made by the rank's warm standby, so the rank page-locks nothing.

A killed rank's teardown holds the GPU driver's global lock while the driver unpins what the
rank page-locked, and everything else on the host that allocates GPU memory waits for it,
the replacement's model first: the memory tier's slots (14 GB for a 1.14B model's two) held
it 0.25-0.31 s, against 0.04-0.05 s when another process had them page-locked and made the
copies (``bench/results/copier-ipc-h200.json``: same 51 GB/s, the takeover's 30 GB
allocated 0.10-0.13 s after the kill against 0.33-0.39 s).

So the standby of a rank's local index, which maps and page-locks that rank's slots anyway
(for its restore), serves them: it listens on ``copier-r<rank>.sock`` in the node's memory
directory (mode 0700; same user only, ``SO_PEERCRED``). The rank connects, says how many
bytes of each own slot a save needs (``hello``; the standby page-locks that much and says
``ready``), shares the CUDA storages of its state through CUDA IPC (``share``: the handle
fields of ``UntypedStorage._share_cuda_``, never a pickle) and asks for each save's copies
(``copy``: storage, byte range, slot offset; device-to-host for a save, host-to-device for
a survivor's restore). The standby waits for nothing on the device: the rank sends a save's
copies once its step's event has completed, and waits on the host for ``done`` before its
next optimizer step changes what was copied. A rank whose standby is gone, refuses, or has
not come up yet page-locks its own slots and copies as before (``memory.MemoryTier``).

At the hand-off the standby stops serving (``Slots.shared``) before it allocates anything.
Every frame is a 4-byte length and a JSON object parsed into the types below, with bounds.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import ctypes
import json
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

MAX_FRAME = 16 << 20
MAX_STORAGES = 4096  # a state whose storages keep changing is not copied this way
_MAX_BYTES = 1 << 46  # 64 TiB: a storage, an offset, a slot
_MAX_ITEMS = 200_000
_B64 = Annotated[str, Field(max_length=1368, pattern=r"^[A-Za-z0-9+/=]*$")]  # <= 1 KiB
Offset = Annotated[int, Field(ge=0, le=_MAX_BYTES)]


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StorageShare(_Msg):
    """One CUDA storage of the rank: its allocation's IPC handle and its byte range there
    (``UntypedStorage._share_cuda_``'s fields; the copier waits for no event of the rank's
    and holds no reference count: the rank keeps every shared storage alive)."""

    sid: Annotated[int, Field(ge=0, le=1 << 20)]
    device: Annotated[int, Field(ge=0, le=255)]
    handle: _B64
    size: Annotated[int, Field(ge=1, le=_MAX_BYTES)]
    offset: Offset


class Hello(_Msg):
    op: Literal["hello"]
    rank: Annotated[int, Field(ge=0, le=1 << 20)]
    slot_bytes: Annotated[int, Field(ge=1, le=_MAX_BYTES)]


class Share(_Msg):
    op: Literal["share"]
    storages: Annotated[list[StorageShare], Field(max_length=_MAX_ITEMS)]


# (storage id, byte offset in the storage, bytes, byte offset in the slot)
Item = tuple[Annotated[int, Field(ge=0, le=1 << 20)], Offset,
             Annotated[int, Field(ge=1, le=_MAX_BYTES)], Offset]


class Copy(_Msg):
    op: Literal["copy"]
    seq: Annotated[int, Field(ge=0)]
    direction: Literal["d2h", "h2d"]
    slot: Literal["a", "b"]
    items: Annotated[list[Item], Field(max_length=_MAX_ITEMS)]


class Reply(_Msg):
    op: Literal["ready", "done"]
    seq: Annotated[int, Field(ge=-1)] = -1
    ok: bool
    error: Annotated[str, Field(max_length=500)] | None = None
    seconds: Annotated[float, Field(ge=0, le=1e6)] = 0.0


Request = TypeAdapter(Annotated[Hello | Share | Copy, Field(discriminator="op")])
_REPLY = TypeAdapter(Reply)


def socket_path(root: Path, rank: int) -> Path:
    return root / f"copier-r{rank}.sock"


def usable_path(path: Path) -> bool:
    """A Unix socket's path must fit ``sun_path`` (108 bytes with its NUL)."""
    return len(os.fsencode(str(path))) < 104


def send_frame(sock: socket.socket, msg: BaseModel | dict[str, Any]) -> None:
    body = (msg.model_dump_json() if isinstance(msg, BaseModel) else json.dumps(msg)).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def recv_frame(sock: socket.socket) -> bytes | None:
    """One frame's body; None at the end of the stream. ValueError: over ``MAX_FRAME``."""
    head = _recv_exact(sock, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    if n > MAX_FRAME:
        raise ValueError(f"a frame of {n} bytes (at most {MAX_FRAME})")
    body = _recv_exact(sock, n)
    if body is None:
        raise ValueError("the stream ended inside a frame")
    return body


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            if got:
                raise ValueError("the stream ended inside a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def parse_request(body: bytes) -> Hello | Share | Copy:
    """A request, or ValueError naming what is wrong."""
    try:
        return Request.validate_json(body)
    except ValidationError as exc:
        raise ValueError(str(exc.errors(include_url=False)[0])[:300]) from None


def _b64(raw: bytes | None) -> str | None:
    return None if raw is None else base64.b64encode(raw).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


class CopierServer(threading.Thread):
    """The standby's side (see the module): one rank's connection at a time, its copies on a
    stream of this process's own, between ``pinned`` (the standby's page-locked slots,
    ``slot -> (mapping, page-locked bytes)``) and the rank's shared storages."""

    def __init__(self, path: Path, rank: int, pin_slots: Callable[[int], dict[str, Any]],
                 log: Callable[[str], None] = lambda _m: None, device: int = 0) -> None:
        super().__init__(name="slot-copier", daemon=True)
        self.path, self.rank, self._pin_slots, self.log = path, rank, pin_slots, log
        self.device = device  # the standby's GPU (a thread's current device starts at 0)
        self._stopped = threading.Event()
        self._conn: socket.socket | None = None
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen(2)
        self._listener.settimeout(0.2)
        self.copies = 0

    def run(self) -> None:
        try:
            self._accept()
        finally:
            self._listener.close()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                if _peer_uid(conn) != os.getuid():
                    continue
                self._conn = conn
                try:
                    self._serve(conn)
                except Exception as exc:  # noqa: BLE001 - the rank copies on its own then
                    if not self._stopped.is_set():
                        self.log(f"slot copier: the rank's connection ended: "
                                 f"{type(exc).__name__}: {str(exc)[:300]}")
                finally:
                    self._conn = None

    def _serve(self, conn: socket.socket) -> None:
        import torch

        storages: dict[int, torch.Tensor] = {}
        pinned: dict[str, Any] = {}
        stream = None
        maps: IpcMappings | None = None
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)
        try:
            while not self._stopped.is_set():
                body = recv_frame(conn)
                if body is None:
                    return
                req = parse_request(body)
                if self._stopped.is_set():
                    return
                if isinstance(req, Hello):
                    error = None if req.rank == self.rank else \
                        f"this copier serves rank {self.rank}, not {req.rank}"
                    if error is None:
                        pinned = self._pin_slots(req.slot_bytes)
                        if not pinned:
                            error = "could not page-lock the slots"
                    send_frame(conn, Reply(op="ready", ok=error is None, error=error))
                elif isinstance(req, Share):
                    for s in req.storages:
                        if maps is None:
                            maps = IpcMappings(self.device)
                        storages[s.sid] = _open(s, maps)
                else:
                    t0 = time.perf_counter()
                    error = refusal(req, storages, pinned)
                    if error is None:
                        if stream is None:
                            stream = torch.cuda.Stream()
                        _copy(req, storages, pinned[req.slot][0], stream)
                        self.copies += 1
                    send_frame(conn, Reply(op="done", seq=req.seq, ok=error is None,
                                           error=error,
                                           seconds=time.perf_counter() - t0))
        finally:
            storages.clear()
            if maps is not None:  # without the GIL: the rank may have just died
                maps.close()

    def stop(self) -> None:
        """Serve no more, at once (the hand-off: this process is about to become the rank).
        The thread finishes what it is doing (a copy, page-locking) and lets the rank's
        storages go on its own, without the GIL (``IpcMappings``); the socket is removed."""
        self._stopped.set()
        for s in (self._conn, self._listener):
            if s is not None:
                with contextlib.suppress(OSError):  # already closed by the other end
                    s.shutdown(socket.SHUT_RDWR)
        self.path.unlink(missing_ok=True)


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]  # CUipcMemHandle


class _Iface:
    """A device range as ``__cuda_array_interface__``: a tensor over it, owned elsewhere."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}


class IpcMappings:
    """A rank's CUDA allocations opened in this process by their IPC handles, through the
    driver API by ctypes, so the GIL is not held while the driver works: closing the
    mappings of a rank that just died waits for the driver's lock until its teardown is
    done, and the standby's main thread (taking the rank's place) must not wait with it.
    torch's own ``_new_shared_cuda`` frees its mappings in a storage's destructor, under
    the GIL. Handles in another format than the caching allocator's ``cudaMalloc`` one are
    not opened (None); a range past the end of its allocation is refused (ValueError)."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._cu = ctypes.CDLL("libcuda.so.1")
        self._cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                   _IpcHandle, ctypes.c_uint]
        self._cu.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        self._cu.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                     ctypes.POINTER(ctypes.c_size_t),
                                                     ctypes.c_uint64]
        self._bases: dict[bytes, tuple[int, int | None]] = {}  # handle -> (base, bytes)

    def _current(self) -> None:
        """The device's primary context (torch's) current on this thread."""
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for rc in (self._cu.cuDeviceGet(ctypes.byref(dev), self.device),
                   self._cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev),
                   self._cu.cuCtxSetCurrent(ctx)):
            if rc != 0:
                raise ValueError(f"the CUDA driver said {rc} making the context current")
        self._cu.cuDevicePrimaryCtxRelease_v2(dev)  # torch holds it; so did we, briefly

    def tensor(self, handle: bytes, offset: int, nbytes: int) -> Any:
        """A uint8 tensor over ``nbytes`` at ``offset`` in the allocation of ``handle``
        (``UntypedStorage._share_cuda_``'s), or None for a format this does not open."""
        import torch

        if len(handle) != 66 or handle[1:2] != b"c":
            return None
        raw = handle[2:]
        if raw not in self._bases:
            self._current()
            ptr, start, size = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_size_t()
            rc = self._cu.cuIpcOpenMemHandle_v2(ctypes.byref(ptr),
                                                _IpcHandle.from_buffer_copy(raw), 1)
            if rc != 0:
                raise ValueError(f"cuIpcOpenMemHandle: CUDA driver error {rc}")
            known = self._cu.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size),
                                                     ptr.value) == 0
            self._bases[raw] = (ptr.value, size.value if known else None)
        base, size_of = self._bases[raw]
        if size_of is not None and offset + nbytes > size_of:
            raise ValueError(f"bytes {offset}+{nbytes} past the end of a {size_of}-byte "
                             "allocation")
        return torch.as_tensor(_Iface(base + offset, nbytes), device=f"cuda:{self.device}")

    def close(self) -> float:
        """Close every mapping (tensors over them must be gone); returns the seconds."""
        t0 = time.perf_counter()
        if self._bases:
            self._current()
        for base, _ in self._bases.values():
            self._cu.cuIpcCloseMemHandle(base)
        self._bases.clear()
        return time.perf_counter() - t0


def _peer_uid(conn: socket.socket) -> int | None:
    try:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", raw)[1]


def _open(s: StorageShare, maps: IpcMappings) -> Any:

    if s.device != maps.device:
        raise ValueError(f"storage {s.sid} is on GPU {s.device}, this copier on {maps.device}")
    handle = _unb64(s.handle)
    assert handle is not None
    mapped = maps.tensor(handle, s.offset, s.size)
    if mapped is None:  # the connection ends: the rank copies on its own
        raise ValueError(f"storage {s.sid}: an IPC handle of another format than the "
                         "caching allocator's cudaMalloc one (expandable segments?)")
    return mapped


def refusal(req: Copy, storages: dict[int, Any], pinned: dict[str, Any]) -> str | None:
    """Why ``req``'s copies are not made (None: every item is within its storage and the
    slot's page-locked bytes; all are checked before the first copy)."""
    if req.slot not in pinned:
        return f"slot {req.slot} is not page-locked here"
    locked = pinned[req.slot][1]
    for sid, off, n, slot_off in req.items:
        dev = storages.get(sid)
        if dev is None:
            return f"storage {sid} was never shared"
        if off + n > dev.numel():
            return f"storage {sid}: bytes {off}+{n} past its {dev.numel()}"
        if slot_off + n > locked:
            return f"slot {req.slot}: bytes {slot_off}+{n} past the {locked} page-locked"
    return None


def _copy(req: Copy, storages: dict[int, Any], buf: Any, stream: Any) -> None:
    """Make ``req``'s copies (checked by :func:`refusal`) and wait for them."""
    import torch

    host = torch.frombuffer(buf, dtype=torch.uint8, count=len(buf))
    with torch.cuda.stream(stream):
        for sid, off, n, slot_off in req.items:
            d, h = storages[sid][off:off + n], host[slot_off:slot_off + n]
            (h if req.direction == "d2h" else d).copy_(d if req.direction == "d2h" else h,
                                                      non_blocking=True)
    stream.synchronize()


class CopierClient:
    """The rank's side: a connection to its standby's copier. ``ready`` once the standby
    has page-locked the slots; ``dead`` once the connection failed (it is not retried: the
    next standby gets a new client). Copies are asked with :meth:`copy` and answered on a
    reader thread; a save's are sent only once ``after`` (the step's event) completed."""

    def __init__(self, sock: socket.socket, log: Callable[[str], None]) -> None:
        self._sock, self.log = sock, log
        self.ready = threading.Event()
        self.dead: str | None = None
        self._seq = 0
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._sids: dict[tuple[int, int], int] = {}
        self._keep: list[Any] = []  # the shared storages stay alive while shared
        self._outbox: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, name="copier-read", daemon=True).start()
        threading.Thread(target=self._send, name="copier-send", daemon=True).start()

    @classmethod
    def connect(cls, path: Path, rank: int, slot_bytes: int,
                log: Callable[[str], None]) -> CopierClient | None:
        """A client that has said ``hello`` (None: no copier listens there)."""
        if not usable_path(path) or not path.exists():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            send_frame(sock, Hello(op="hello", rank=rank, slot_bytes=slot_bytes))
        except OSError:
            sock.close()
            return None
        return cls(sock, log)

    def usable(self) -> bool:
        return self.ready.is_set() and self.dead is None

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.dead is None:
                self.dead = why
                self.log(f"memory tier: the standby's copier is gone ({why}); this rank "
                         "copies on its own")
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        with contextlib.suppress(OSError):  # already closed by the other end
            self._sock.shutdown(socket.SHUT_RDWR)

    def _read(self) -> None:
        try:
            while True:
                body = recv_frame(self._sock)
                if body is None:
                    return self._fail("the standby closed the connection")
                reply = _REPLY.validate_json(body)
                if reply.op == "ready":
                    if not reply.ok:
                        return self._fail(reply.error or "not ready")
                    self.ready.set()
                    continue
                with self._lock:
                    fut = self._pending.pop(reply.seq, None)
                if fut is None:
                    return self._fail(f"an answer to copy {reply.seq}, never asked")
                if not reply.ok:  # a refusal is not retried: this rank copies on its own
                    fut.set_exception(RuntimeError(reply.error or "copy refused"))
                    return self._fail(f"copy refused: {reply.error}")
                fut.set_result(reply.seconds)
        except (OSError, ValueError, ValidationError) as exc:
            self._fail(f"{type(exc).__name__}: {str(exc)[:200]}")

    def _send(self) -> None:
        while True:
            job = self._outbox.get()
            if job is None:
                return
            after, frames = job
            try:
                if after is not None:
                    while not after.query():  # the step that made the bytes
                        if self.dead is not None:
                            break
                        time.sleep(0.0005)
                for frame in frames:
                    send_frame(self._sock, frame)
            except OSError as exc:
                self._fail(f"{type(exc).__name__}: {exc}")

    def copy(self, direction: str, slot: str, pieces: list[tuple[Any, int]],
             after: Any = None) -> concurrent.futures.Future:
        """Copy each ``(tensor, slot offset)`` (contiguous, on this rank's GPU) to or from
        ``slot``; the future resolves with the copier's seconds (an exception: not made)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        shares, items = [], []
        for t, slot_off in pieces:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            sid = self._sids.get(key)
            if sid is None and len(self._sids) >= MAX_STORAGES:
                self._fail(f"over {MAX_STORAGES} storages shared: the state's keep changing")
            if sid is None:
                sid = self._sids[key] = len(self._sids)
                f = storage._share_cuda_()
                shares.append(StorageShare(
                    sid=sid, device=f[0], handle=_b64(f[1]), size=f[2], offset=f[3]))
                self._keep.append(storage)
            n = t.numel() * t.element_size()
            if n:
                items.append((sid, t.storage_offset() * t.element_size(), n, slot_off))
        with self._lock:
            if self.dead is not None:
                fut.set_exception(ConnectionError(self.dead))
                return fut
            seq, self._seq = self._seq, self._seq + 1
            self._pending[seq] = fut
        frames: list[Any] = [Share(op="share", storages=shares)] if shares else []
        frames.append(Copy(op="copy", seq=seq, direction=direction, slot=slot, items=items))
        self._outbox.put((after, frames))
        return fut

    def close(self) -> None:
        self._outbox.put(None)
        self._fail("closed")
        self._sock.close()
