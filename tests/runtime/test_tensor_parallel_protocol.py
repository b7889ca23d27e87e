"""Tensor parallel's protocol between rank 0 and the others, in memory: rank 0's calls reaching the others on their
callers' streams; a failed or hung rank's part of a step, or a lost rank, as rank 0 sees it (LeaderRunner,
DeviceWatch, with fake runners and a fake message channel); a follower skipping collectives until the renewal; the
NCCL communicators' making and renewal over a real store (nccl4py's Communicator faked: no GPU here)."""

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from metrale.runtime.batch import Segment, build_batch
from metrale.runtime.errors import CollectiveFailed, RankLost
from metrale.runtime.parallel.follower import follow
from metrale.runtime.parallel.group import GlooGroup, Shard
from metrale.runtime.parallel.launch import free_address
from metrale.runtime.parallel.leader import RENEW, STOP, LeaderRunner
from metrale.runtime.sequence import BlockTable


class Recorded:
    """A runner that records what it is asked: stream bindings and calls, in order."""

    queues_work = False

    def __init__(self):
        self.calls = []

    def bind_stream(self, stream):
        self.calls.append(("bind", stream))

    def run_forward(self, forward, batch, replayable):
        self.calls.append(("forward", batch))

    def queue_sample(self, logits, rows):
        return SimpleNamespace(result=lambda: "sampled")


def a_batch():
    return build_batch([Segment(BlockTable([3]), 0, (5, 6), True)], 4)


class Mailbox:
    """Rank 0's messages to the others, in memory: what the leader sends, a follower receives."""

    def __init__(self, shard, timeout_s: float = 60.0):
        self.shard, self.sent, self.lost = shard, [], None
        self.timeout, self.aborted = timedelta(seconds=timeout_s), threading.Event()

    def send(self, message):
        self.sent.append(message)

    def receive(self):
        return self.sent.pop(0)

    def check(self):
        GlooGroup.check(self)

    def lose(self, why):
        self.lost = why
        self.aborted.set()          # as NCCL's abort ends the device's wait for the lost rank's part

    interrupted, reported, renewed, generation, announced = False, False, 0, 0, 0

    def announce_renewal(self):
        self.announced += 1

    reports = 0

    def renewing(self):
        return False

    def report_failure(self):
        self.reported, self.reports = True, self.reports + 1

    def failure_reported(self):
        return self.reported

    def interrupt(self):
        self.interrupted = True
        self.aborted.set()

    def drop_collectives(self):
        pass

    def renew_collectives(self):
        self.renewed += 1
        self.generation += 1
        self.interrupted = self.reported = False


def test_a_follower_runs_each_call_on_the_stream_of_rank_0_s_caller():
    """Rank 0's calls from two stream threads: each reaches the other rank with its caller's stream, which that rank
    binds before it runs the call."""
    leader = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    mailbox, batch = leader.group, a_batch()

    def on_stream(stream):
        leader.bind_stream(stream)
        leader.run_forward(None, batch, False)
    for stream in (1, 0, 1):
        thread = threading.Thread(target=on_stream, args=(stream,))
        thread.start()
        thread.join()
    mailbox.send(STOP)
    follower = Recorded()
    follow(mailbox, None, follower, ())
    assert [call[0] for call in follower.calls] == ["bind", "forward"] * 3
    assert [call[1] for call in follower.calls[::2]] == [1, 0, 1]


def test_once_a_rank_is_lost_every_call_and_every_sampling_under_way_is_rank_lost():
    """A sampling queued before the loss was waited for on the device until the collectives were left: its tokens
    are not the model's, so its result is RankLost too."""
    leader = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    queued = leader.queue_sample(None, [])
    leader.group.lost = "metrale-rank-1 ended (exit code -9)"
    with pytest.raises(RankLost, match="exit code -9"):
        queued.result()
    with pytest.raises(RankLost):
        leader.run_forward(None, a_batch(), False)
    assert leader.group.sent == []


class FakeCommunicator:
    """nccl4py's Communicator as NcclCollectives makes and aborts it, without a GPU: what each was made with."""

    made = []

    def __init__(self, size, rank, unique_id):
        self.size, self.rank, self.unique_id, self.aborted, self.ptr = size, rank, bytes(unique_id), False, 0
        FakeCommunicator.made.append(self)

    @classmethod
    def init(cls, size, rank, unique_id):
        return cls(size, rank, unique_id)

    def abort(self):
        self.aborted = True


def test_the_ranks_nccl_communicators_meet_under_each_generation_and_the_old_one_is_aborted(monkeypatch):
    """Rank 0's unique id reaches the other rank through the store, a new one at each renewal (after a failed call,
    on rank 0 alone here), when every rank aborts the old communicator first (its operations waiting for a rank that
    stopped partway would hold the streams), after letting go of what captured it (NCCL's abort waits for those
    graphs); leaving the collectives at the failure aborts nothing yet (the others abort theirs at the renewal). A
    failure reported by rank 1 is seen by rank 0 under that generation only; a lost rank aborts the communicator
    too."""
    from nccl.core import UniqueId

    from metrale.runtime.backend.cuda import collectives

    ids = iter(UniqueId.from_bytes(bytes([n]) * 128) for n in range(1, 10))
    monkeypatch.setattr(collectives, "get_unique_id", lambda: next(ids))
    monkeypatch.setattr(collectives, "Communicator", FakeCommunicator)
    FakeCommunicator.made = []
    address, made, released, left = free_address(), {}, [], {}

    def rank(r):
        group = GlooGroup(Shard(r, 2), address, timeout_s=20)
        nccl = collectives.NcclCollectives(group, SimpleNamespace(set_current=lambda: None))
        nccl.before_abort.append(lambda: released.append((r, [c.aborted for c in FakeCommunicator.made
                                                              if c.rank == r])))
        if r == 0:
            group.drop_collectives()
            left[r] = [c.aborted for c in FakeCommunicator.made if c.rank == r]
        group.renew_collectives()
        if r == 1:
            group.report_failure()
        made[r] = group
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    zero, one = ([c for c in FakeCommunicator.made if c.rank == r] for r in (0, 1))     # each rank's, in order
    assert [c.size for c in zero + one] == [2] * 4
    assert [c.unique_id for c in zero] == [c.unique_id for c in one] and zero[0].unique_id != zero[1].unique_id
    assert [c.aborted for c in zero + one] == [True, False, True, False] and not any(left[0])
    assert sorted(r for r, _ in released) == [0, 1] and not any(any(before) for _, before in released)
    assert made[0].failure_reported() and made[0].generation == 1
    made[0].renew_collectives, made[0].generation = None, 2      # a later generation's: not that failure
    assert not made[0].failure_reported()
    group = made[1]
    group.lose("metrale-rank-0 ended (exit code -9)")
    deadline = time.monotonic() + 10
    while not all(c.aborted for c in one) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(c.aborted for c in one)
    with pytest.raises(RankLost, match="exit code -9"):
        group.check()


class Hanging(Recorded):
    """A CUDA-like runner whose sampling waits on the device for a rank that hangs: until the collectives are
    aborted."""

    queues_work = True

    def __init__(self, aborted):
        super().__init__()
        self.aborted = aborted

    def queue_sample(self, logits, rows):
        return SimpleNamespace(result=lambda: self.aborted.wait(30) and "garbage")


def test_a_wait_on_the_device_past_the_collectives_timeout_loses_the_ranks():
    """A rank that hangs (alive, never done): NCCL waits for its part without end. Rank 0's wait for a sampling passes
    the collectives' timeout, the ranks are lost (the abort ends the wait), the sampling is RankLost and so is every
    call after it."""
    group = Mailbox(Shard(0, 2), timeout_s=0.3)
    leader = LeaderRunner(Hanging(group.aborted), group)
    started = time.monotonic()
    with pytest.raises(RankLost, match="passed 0.3 s"):
        leader.queue_sample(None, []).result()
    assert time.monotonic() - started < 5
    with pytest.raises(RankLost):
        leader.run_forward(None, a_batch(), False)
    leader.watch.stop()


def test_a_failure_reported_by_another_rank_fails_the_waiting_step_alone_and_the_ranks_renew():
    """Rank 1's part of the step failed (a bug there) and it said so: rank 0's wait on the device for that part, which
    NCCL would hold without end, is interrupted (the collectives aborted); the sampling fails as a StepFailed (the
    engine undoes the step), rank 0 sends RENEW and renews, and the next call goes on."""
    group = Mailbox(Shard(0, 2), timeout_s=30)
    leader = LeaderRunner(Hanging(group.aborted), group)
    queued = leader.queue_sample(None, [])
    group.reported = True
    started = time.monotonic()
    with pytest.raises(CollectiveFailed, match="another tensor-parallel rank's part"):
        queued.result()
    assert time.monotonic() - started < 5 and group.lost is None
    assert group.sent == [RENEW] and group.renewed == group.announced == 1 and not group.interrupted
    leader.run_forward(None, a_batch(), False)
    assert [message[0] for message in group.sent] == [RENEW[0], "forward"]
    leader.watch.stop()


class Queuing(Recorded):
    """A runner whose forwards and samplings are queued on a device (CUDA's)."""

    queues_work = True


def test_a_sampling_of_a_forward_queued_before_the_collectives_were_renewed_is_a_failed_step():
    """Another stream's call failed and the ranks renewed the collectives after this forward was queued (before or
    after its sampling was): the renewal's abort ended that work partway, so its tokens are not the model's. On a
    device that does not queue work (the CPU's), a forward is done when it returns, and its sampling stands."""
    for renewed_before_sampling in (True, False):
        leader = LeaderRunner(Queuing(), Mailbox(Shard(0, 2)))
        leader.run_forward(None, a_batch(), False)
        if renewed_before_sampling:
            leader.group.renew_collectives()
        queued = leader.queue_sample(None, [])
        if not renewed_before_sampling:
            leader.group.renew_collectives()
        with pytest.raises(CollectiveFailed):
            queued.result()
        leader.run_forward(None, a_batch(), False)
        assert leader.queue_sample(None, []).result() == "sampled"
        leader.watch.stop()
    cpu = LeaderRunner(Recorded(), Mailbox(Shard(0, 2)))
    cpu.run_forward(None, a_batch(), False)
    queued = cpu.queue_sample(None, [])
    cpu.group.renew_collectives()
    assert queued.result() == "sampled"


class FailingOnce(Recorded):
    def run_forward(self, forward, batch, replayable):
        super().run_forward(forward, batch, replayable)
        if len([c for c in self.calls if c[0] == "forward"]) == 1:
            raise RuntimeError("a bug in this rank's forward")

    def copy_block_prefixes(self, layers, copies):
        self.calls.append(("copy", copies))


def test_a_follower_whose_part_failed_reports_it_and_runs_no_collectives_until_renewed():
    """Its collectives would pair with the rest of the failed call's on rank 0: another stream's forward sent meanwhile
    is left to fail there too; a cache copy (no collectives) still runs; after RENEW the next forward runs."""
    mailbox = Mailbox(Shard(1, 2))
    batch = a_batch()
    mailbox.sent = [("forward", 0, batch, False), ("forward", 1, batch, False), ("copy_blocks", 0, [(1, 2, 3)]),
                    RENEW, ("forward", 0, batch, False), STOP]
    follower = FailingOnce()
    follow(mailbox, None, follower, ())
    assert [c[0] for c in follower.calls if c[0] != "bind"] == ["forward", "copy", "forward"]
    assert mailbox.reports == 1 and mailbox.renewed == 1


def test_a_communicator_whose_init_never_ends_is_a_lost_rank(monkeypatch):
    """NCCL's init waits for every rank without end: one that died after the store's meeting must not hold this one
    past the collectives' timeout."""
    from nccl.core import UniqueId

    from metrale.runtime.backend.cuda import collectives

    never = threading.Event()
    monkeypatch.setattr(collectives, "get_unique_id", lambda: UniqueId.from_bytes(bytes(128)))
    monkeypatch.setattr(collectives, "Communicator", SimpleNamespace(init=lambda *args: never.wait()))
    group = GlooGroup(Shard(0, 1), free_address(), timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RankLost, match="not made within 0.5 s"):
        collectives.NcclCollectives(group, SimpleNamespace(set_current=lambda: None))
    assert time.monotonic() - started < 5
    never.set()
