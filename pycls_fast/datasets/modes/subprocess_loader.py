"""'subprocess' mode: the decoding threads in child processes, batches in shared memory.

    training process                           child process (subprocess_worker.py)
      ImageLoader -> SubprocessLoader            decoding threads (iterate_threaded)
        sends the epoch's batch plan  ------->     decode each batch into a slot
        yields slot views as batches  <-------     ("batch", seq, slot, labels, bad)
        frees a slot once its batch is dead ->

Threads inside the training process share its GIL with the thread that launches the
step's kernels: every eager torch op releases and re-takes it, so per-image Python in
the loader (Pillow glue, timm's augmentations) lengthens the step
(docs/PERFORMANCE.md, "The loader beside the step"). Here the per-image work runs in
`processes` children (`DATA_LOADER.SUBPROCESSES`), each with its share of
`DATA_LOADER.NUM_WORKERS` threads; the training process only reads small messages
and hands out views of the slots the children wrote. Batch k of an epoch is decoded
by child k % processes, with the same per-image seeds as the other modes: the same
batches, bit for bit.

Slots are anonymous shared memory (`memfd_create`), made by this process and passed
to the children as file descriptors, and registered with CUDA (pinned) when batches
go to a GPU, so the device copy is asynchronous and needs no staging copy. A slot
goes back to its child when the batch's last view is gone, and on CUDA once the
consumer's stream has passed an event recorded after that (the copy out of the slot
was queued before). Each child keeps enough free slots for its batches in flight
whatever the consumer holds on to (more are made when it holds many); an epoch left
early gives the child back every slot it took (those of the batches it had not sent).

The children are started at the first epoch and kept for the loader's life; they end
when this process closes the loader, exits, or is killed (their socket closes).
"""

import collections
import contextlib
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from multiprocessing.connection import wait

import numpy as np
import torch

import pycls_fast
from pycls_fast.datasets.modes.batch import Batch, ImageDecoder
from pycls_fast.datasets.modes.subprocess_worker import (
    recv_message,
    send_message,
)
from pycls_fast.errors import LoaderProcessError

logger = logging.getLogger(__name__)

# Seconds a child may take to import and report ready.
START_TIMEOUT_S = 120.0
# Slots beyond a child's batches in flight: the batch the step uses, the one the
# device prefetcher copies ahead, one whose copy a CUDA event still guards.
SPARE_SLOTS = 3
# Seconds a batch may be awaited before a warning (repeated as long as it is awaited):
# a live child that sends nothing is stuck (a hung read, no slot to decode into).
STALL_WARNING_S = 300.0


def _new_slot(shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
    """(file descriptor, uint8 array of `shape`) of fresh anonymous shared memory."""
    fd = os.memfd_create("pycls_fast-batch", os.MFD_CLOEXEC)
    size = int(np.prod(shape))
    os.ftruncate(fd, size)
    buf = mmap.mmap(fd, size)
    return fd, np.frombuffer(buf, dtype=np.uint8, count=size).reshape(shape)


class _Slot:
    """A slot as the training process sees it."""

    def __init__(self, array: np.ndarray, pinned: bool) -> None:
        self.array = array
        self.pinned = pinned
        if pinned:
            # Page-locked in place: the device copy reads the shared memory itself.
            torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)

    def unpin(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.array.ctypes.data)
            self.pinned = False


class _Child:
    """One child process, its socket and its slots."""

    def __init__(self, threads: int, prefetch: int, stats_period: float) -> None:
        self.prefetch = prefetch
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # The child imports this very package, wherever it was imported from here.
        root = os.path.dirname(os.path.dirname(os.path.abspath(pycls_fast.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (root, env.get("PYTHONPATH", "")) if p
        )
        module = "pycls_fast.datasets.modes.subprocess_worker"
        args = [str(theirs.fileno()), str(threads), str(prefetch), str(stats_period)]
        self.process = subprocess.Popen(
            [sys.executable, "-m", module, *args], pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()
        self.slots: dict[int, _Slot] = {}
        self.dropped: dict[int, _Slot] = {}  # of an earlier shape, batch still out
        self._next_id = 0
        self.shape: tuple[int, ...] | None = None
        self.held: set[int] = set()  # slots whose batches are out with the consumer
        self.decoder: ImageDecoder | None = None
        self.pid = self.process.pid
        message = self.receive(timeout=START_TIMEOUT_S)
        if message[0] != "ready":
            raise LoaderProcessError(f"loader subprocess said {message[0]!r} at start")

    def send(self, message, fds=()) -> None:
        try:
            send_message(self.sock, self.lock, message, fds)
        except OSError:
            raise self._ended() from None

    def _ended(self) -> LoaderProcessError:
        try:
            status = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            status = None
        how = (
            "is not answering" if status is None
            else f"was killed by signal {-status}" if status < 0
            else f"exited with status {status}"
        )  # fmt: skip
        return LoaderProcessError(f"the loader subprocess (pid {self.pid}) {how}")

    def receive(self, timeout: float | None = None):
        """The next message, EOF turned into LoaderProcessError."""
        if timeout is not None and not wait([self.sock], timeout):
            raise LoaderProcessError(
                f"the loader subprocess (pid {self.pid}) did not answer in {timeout} s"
            )
        try:
            message, fds = recv_message(self.sock)
        except (EOFError, OSError):
            raise self._ended() from None
        for fd in fds:  # The child sends none; never leak one.
            os.close(fd)
        return message

    def use(self, decoder: ImageDecoder, shape: tuple[int, ...], pin: bool) -> None:
        """Sends `decoder` and makes slots of `shape`, unless the child has them."""
        if decoder is not self.decoder:
            self.send(("decoder", decoder))
            self.decoder = decoder
        if shape != self.shape:
            self.send(("drop_slots",))
            for slot_id in list(self.slots):
                self._forget(slot_id)
            self.shape = shape
            self.add_slots(self.prefetch + 1 + SPARE_SLOTS, pin)

    def _forget(self, slot_id: int) -> None:
        slot = self.slots.pop(slot_id)
        if slot_id in self.held:
            self.dropped[slot_id] = slot  # unpinned once its batch is gone
        else:
            slot.unpin()

    def returned(self, ids: list[int]) -> list[int]:
        """Marks the slots `ids` as back from the consumer; returns those the child
        still uses (the others were of an earlier shape: unpinned here)."""
        self.held.difference_update(ids)
        for slot_id in ids:
            if slot_id in self.dropped:
                self.dropped.pop(slot_id).unpin()
        return [i for i in ids if i in self.slots]

    def add_slots(self, count: int, pin: bool) -> None:
        made = [_new_slot(self.shape) for _ in range(count)]
        ids = list(range(self._next_id, self._next_id + count))
        self._next_id += count
        for slot_id, (_, array) in zip(ids, made, strict=True):
            self.slots[slot_id] = _Slot(array, pin)
        try:
            self.send(("slots", [(i, self.shape) for i in ids]), [fd for fd, _ in made])
        finally:
            for fd, _ in made:
                os.close(fd)

    def close(self) -> None:
        try:
            self.sock.close()  # The child leaves when its socket closes.
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        for slot_id in list(self.slots):
            self._forget(slot_id)


class SubprocessLoader:
    """The child processes of one ImageLoader; `iterate` yields an epoch's batches.

    `processes` children, `threads` decoding threads each, about `prefetch` batches
    decoded ahead in all; `pin_memory`: slots page-locked for CUDA copies;
    `stats_period` > 0: the children log their decoding statistics (as 'threads'
    mode does) through this process's logging.
    """

    def __init__(
        self,
        processes: int,
        threads: int,
        prefetch: int,
        pin_memory: bool = False,
        stats_period: float = 0.0,
    ) -> None:
        self.processes = processes
        self.threads = threads
        self.prefetch = max(1, -(-prefetch // processes))
        self.pin_memory = pin_memory
        self.stats_period = stats_period
        self.children: list[_Child] = []
        self._token = 0
        # Slots whose batches died, as (child, slot), appended by finalizers in any
        # thread; handled by the consumer's thread in `_release`.
        self._released = collections.deque()
        self._guarded = collections.deque()  # (CUDA event, child, slot)
        self._closed = False

    def _start(self) -> None:
        while len(self.children) < self.processes:
            child = _Child(self.threads, self.prefetch, self.stats_period)
            self.children.append(child)
            logger.info(
                "loader subprocess %d of %d started (pid %d, %d threads)",
                len(self.children),
                self.processes,
                child.pid,
                self.threads,
            )

    def iterate(
        self, decoder: ImageDecoder, batches: Iterable[np.ndarray], epoch: int
    ) -> Iterator[Batch]:
        """Yields one Batch per index array of `batches`, in order (as
        `iterate_threaded`); closing the generator early stops the children's work
        on this epoch."""
        if self._closed:
            raise RuntimeError("the loader's subprocesses are closed")
        self._start()
        batches = [np.asarray(b, dtype=np.int64) for b in batches]
        shape = (max((len(b) for b in batches), default=1), *decoder.shape)
        self._token += 1
        token = self._token
        for c, child in enumerate(self.children):
            child.use(decoder, shape, self.pin_memory)
            items = [(s, b) for s, b in enumerate(batches) if s % self.processes == c]
            child.send(("epoch", token, epoch, items))
        finished = False
        try:
            for seq in range(len(batches)):
                yield self._next_batch(self.children[seq % self.processes], token, seq)
            finished = True
        finally:
            if not finished:
                for child in self.children:
                    with contextlib.suppress(LoaderProcessError):  # already ended
                        child.send(("stop", token))

    def _next_batch(self, child: _Child, token: int, seq: int) -> Batch:
        since = warned = time.monotonic()
        while True:
            self._release()
            now = time.monotonic()
            if now - warned >= STALL_WARNING_S:
                warned = now
                logger.warning(
                    "no batch from the loader subprocess (pid %d) for %.0f s "
                    "(%d slots, %d of them with the consumer); still waiting",
                    child.pid,
                    now - since,
                    len(child.slots),
                    len(child.held),
                )
            # While a CUDA event guards a slot, look at it again every millisecond.
            timeout = 0.001 if self._guarded else warned + STALL_WARNING_S - now
            if not wait([child.sock], max(0.0, timeout)):
                continue
            message = child.receive()
            kind = message[0]
            if kind == "log":
                logging.getLogger(message[1]).log(message[2], "%s", message[3])
            elif kind == "error" and message[1] == token:
                _, _, name, text, trace = message
                logger.debug("loader subprocess (pid %d):\n%s", child.pid, trace)
                raise LoaderProcessError(f"loader subprocess: {name}: {text}")
            elif kind == "batch":
                _, got_token, got_seq, slot_id, count, labels, bad = message
                if got_token != token:  # a batch of an abandoned epoch
                    child.send(("free", [slot_id]))
                    continue
                if got_seq != seq:
                    raise LoaderProcessError(
                        f"loader subprocess sent batch {got_seq}, expected {seq}"
                    )
                return self._batch(child, slot_id, count, labels, bad)

    def _batch(self, child, slot_id, count, labels, bad) -> Batch:
        view = child.slots[slot_id].array[...]
        child.held.add(slot_id)
        weakref.finalize(view, self._released.append, (child, slot_id))
        # torch keeps `view` alive as long as any tensor made from it.
        images = torch.from_numpy(view)[:count].permute(0, 3, 1, 2)
        # Enough free slots for the batches in flight, whatever the consumer keeps.
        if len(child.slots) - len(child.held) < child.prefetch + 2:
            child.add_slots(1, self.pin_memory)
        return Batch(images, torch.from_numpy(labels), bad)

    def _release(self) -> None:
        """Gives back to their children the slots whose batches are gone."""
        free = collections.defaultdict(list)
        while self._released:
            child, slot_id = self._released.popleft()
            slot = child.slots.get(slot_id) or child.dropped.get(slot_id)
            if slot is not None and slot.pinned and torch.cuda.is_initialized():
                # The copy out of the slot was queued on this stream (or one it has
                # waited for) before the batch died.
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream())
                self._guarded.append((event, child, slot_id))
            else:
                free[child].append(slot_id)
        while self._guarded and self._guarded[0][0].query():
            _, child, slot_id = self._guarded.popleft()
            free[child].append(slot_id)
        for child, ids in free.items():
            live = child.returned(ids)
            if live and not self._closed:
                child.send(("free", live))

    def close(self) -> None:
        """Ends the children (and frees the slots once their batches are gone)."""
        self._closed = True
        for child in self.children:
            child.close()
        self.children = []
