"""A tensor-parallel worker's collectives on the device: NCCL (through nccl4py) sums and gathers of device tensors,
queued on the calling stream like any kernel, so a decode graph captures them with the rest of its launches.

One communicator per worker, its unique id handed from rank 0 to the others through the ranks' store
(parallel/group.py). Every rank queues the same collectives in the same order (rank 0's calls are mirrored one at a
time, parallel/leader.py), and NCCL orders a communicator's operations among themselves whatever stream queued them.

After a call that failed partway every rank aborts the communicator at rank 0's RENEW (its operations still queued,
some waiting for a rank that stopped partway, end) and they make a new one together. NCCL's abort waits for every
graph that captured the communicator to be gone, so what holds them lets go first (before_abort: the runner's
graphs, captured again at their next use). Once a rank is lost, or another rank's part of a step failed, rank 0
detaches the communicator and aborts it on a thread of its own, which ends its wait on the device for that part.

NVLink multicast (NVLS) stays off unless the environment turns it on (NCCL_NVLS_ENABLE=1): on hosts whose GPUs
others share, a program using it can take them out of service."""

import contextlib
import os
import threading

from nccl.bindings import nccl as bindings
from nccl.core import Communicator, UniqueId, get_unique_id

from metrale.runtime.backend.cuda.tensor import DeviceTensor
from metrale.runtime.errors import CollectiveFailed, InvalidArgument, RankLost

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # read by NCCL at its first communicator, after this import

# How long an abort waits for the communicator while a call on it holds it.
ABORT_WAIT_S = 30.0
NCCL_DTYPES = {"bfloat16": bindings.DataType.Bfloat16, "float32": bindings.DataType.Float32,
               "float16": bindings.DataType.Float16}


class NcclCollectives:
    """group: the ranks' GlooGroup (its shard, store and generation)."""

    def __init__(self, group, device):
        """device: this rank's cuda.core Device (current on the threads that make communicators)."""
        self.group, self.shard, self.device = group, group.shard, device
        self._communicator: Communicator | None = None
        self._comm = None          # the communicator's binding handle, for the per-layer calls
        # Every use of the communicator, and its abort (from any thread), one at a time: NCCL allows no two at once.
        self._lock = threading.Lock()
        # Called before an abort, under the lock: what captured the communicator (graphs) lets go of it.
        self.before_abort = []
        self._make()
        group.attach(self)

    def renew(self) -> None:
        """The communicator aborted (where no detach() took it already) and a new one made, every rank together,
        under the group's current generation (each rank within the store's timeout, else RankLost)."""
        self.close()
        self._make()

    def close(self) -> None:
        """The communicator aborted, what captured it let go of first: so that its abort, here or on the thread
        detach() started, can end."""
        with self._holding():
            communicator = self.detach()
            for let_go in self.before_abort:
                let_go()
            if communicator is not None:
                communicator.abort()

    def detach(self):
        """The communicator, taken out of use at once (every later call fails until renew(); a call already holding
        it goes on), for abort_detached() on a thread of its own. From any thread: it waits for nothing."""
        communicator, self._communicator, self._comm = self._communicator, None, None
        return communicator

    def abort_detached(self, communicator) -> None:
        """detach()'s communicator aborted once no call holds it: its operations on this rank's streams end at once
        (NCCL raises its abort flag first), though the abort itself may wait for what captured it until renew() lets
        go of that."""
        with self._holding():
            communicator.abort()

    @contextlib.contextmanager
    def _holding(self):
        """The lock, where it comes within ABORT_WAIT_S: an enqueue stuck on the host keeps it, and an abort must go
        ahead regardless."""
        locked = self._lock.acquire(timeout=ABORT_WAIT_S)
        try:
            yield
        finally:
            if locked:
                self._lock.release()

    def _make(self) -> None:
        key = f"nccl.{self.group.generation}"
        try:
            if self.shard.rank == 0:
                unique_id = get_unique_id()
                self.group.store.set(key, bytes(unique_id))
            else:
                unique_id = UniqueId.from_bytes(self.group.store.get(key))
        except RuntimeError as error:
            raise RankLost(f"tensor-parallel ranks did not meet to make their NCCL communicator: {error}") from error
        communicator = self._initialized(unique_id)
        with self._lock:
            self._communicator, self._comm = communicator, bindings.Comm(communicator.ptr)

    def _initialized(self, unique_id) -> Communicator:
        """NCCL's communicator, made on a thread of its own (with this rank's device current there): its init waits
        for every rank without end, and one that never comes (it died after the store's meeting) must not hold this
        one; past the collectives' timeout the ranks are lost (RankLost), and that thread is left waiting."""
        made = {}

        def init():
            try:
                self.device.set_current()
                made["communicator"] = Communicator.init(self.shard.size, self.shard.rank, unique_id)
            except Exception as error:      # NCCL's own (nccl.bindings' NCCLError), nccl4py's NcclInvalid, CUDA's
                made["error"] = error
        thread = threading.Thread(target=init, name="metrale-nccl-init", daemon=True)
        thread.start()
        thread.join(self.group.timeout.total_seconds())
        if "communicator" in made:
            return made["communicator"]
        why = made.get("error", f"not made within {self.group.timeout.total_seconds():g} s")
        raise RankLost(f"tensor-parallel NCCL communicator failed: {why}")

    def all_reduce(self, x: DeviceTensor, stream) -> DeviceTensor:
        """x summed over the ranks, in place, in x's dtype."""
        if not x.is_contiguous:
            raise InvalidArgument(f"a tensor-parallel sum of a strided {x.shape} tensor")
        self._queue("sum", bindings.all_reduce, stream, x.ptr, x.ptr, x.numel, int(NCCL_DTYPES[x.dtype]),
                    int(bindings.RedOp.Sum))
        return x

    def all_gather(self, parts: DeviceTensor, count: int, stream) -> None:
        """Every rank's `count` elements, in rank order from parts' start, on every rank: in place, each rank's own
        already at parts' start + rank * count."""
        mine = parts.ptr + self.shard.rank * count * parts.itemsize
        self._queue("gather", bindings.all_gather, stream, mine, parts.ptr, count, int(NCCL_DTYPES[parts.dtype]))

    def _queue(self, what: str, collective, stream, *args) -> None:
        """collective(*args, communicator, stream) queued on the stream; NCCL's error a CollectiveFailed."""
        with self._lock:
            try:
                collective(*args, self._current(), int(stream.handle))
            except bindings.NCCLError as error:
                raise CollectiveFailed(f"tensor-parallel {what} failed: {error}") from error

    def _current(self):
        if self._comm is None:
            raise CollectiveFailed("tensor-parallel NCCL communicator aborted after a failed call, not yet renewed")
        return self._comm
