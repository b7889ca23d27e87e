"""StreamPacer: a stream queues its guess before handing the answer over while the device step is the longer path,
and hands the answer over first once the answer's round trip is the longer one."""

import threading
import time

import pytest

from metrale.runtime.run_ahead import StreamPacer
from metrale.runtime.step import StepOutput


class FakeGuess:
    """Queues in no time, then 'runs on the device' for device_s."""
    queued = False

    def __init__(self, device_s: float, events: list):
        self.device_s, self.events = device_s, events

    def run(self, on_queued):
        self.events.append("queued")
        on_queued()
        time.sleep(self.device_s)

    def skip(self):
        self.events.append("skipped")


def drive(pacer: StreamPacer, device_s: float, round_trip_s: float, steps: int) -> list[list[str]]:
    """Steps of one stream: each answer's next request arrives round_trip_s after the answer was handed over (on
    another thread, as the event loop's), and the stream takes it once its guess is done."""
    orders = []
    for _ in range(steps):
        events, arrived = [], threading.Event()

        def answer():
            events.append("answer")
            timer = threading.Timer(round_trip_s, lambda: (pacer.request_arrived(), arrived.set()))
            timer.start()

        pacer(StepOutput(ahead=FakeGuess(device_s, events)), True, answer)
        orders.append(events)
        arrived.wait()
    return orders


def test_long_device_steps_queue_the_guess_first():
    orders = drive(StreamPacer(), device_s=0.02, round_trip_s=0.001, steps=4)
    assert all(order[:2] == ["queued", "answer"] for order in orders)


def test_long_round_trips_hand_the_answer_over_first():
    pacer = StreamPacer()
    orders = drive(pacer, device_s=0.001, round_trip_s=0.03, steps=4)
    assert orders[0][:2] == ["queued", "answer"]      # nothing measured yet
    assert all(order[:2] == ["answer", "queued"] for order in orders[1:])
    assert pacer.round_trip_s > pacer.device_s


def test_queued_work_skips_the_guess_and_answers():
    events = []
    StreamPacer()(StepOutput(ahead=FakeGuess(0.0, events)), False, lambda: events.append("answer"))
    assert events == ["answer", "skipped"]


def test_an_answer_that_cannot_be_handed_over_still_settles_the_guess():
    """The guess is run (or skipped) even where handing the answer over raises: a guess left pending would hold its
    sequences' next step forever."""
    cases = {(True, True): ["answer", "queued"], (True, False): ["queued", "answer"],
             (False, False): ["answer", "skipped"]}
    for (stream_idle, answer_first), expected in cases.items():
        events, pacer = [], StreamPacer()
        pacer.round_trip_s = 1.0 if answer_first else 0.0

        def hand_over():
            events.append("answer")
            raise RuntimeError("the call was cancelled meanwhile")

        with pytest.raises(RuntimeError):
            pacer(StepOutput(ahead=FakeGuess(0.0, events)), stream_idle, hand_over)
        assert events == expected, (stream_idle, answer_first)
