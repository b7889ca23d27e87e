"""The collector stays off while any lane captures a CUDA graph (no GPU needed: the guard is host state)."""

import gc
import threading

from metrale.runtime.backend.cuda import graphs


def test_the_collector_stays_off_until_the_last_overlapping_capture_ends():
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def first():
        with graphs._no_collection():
            first_in.set()
            second_in.wait(5)
        seen["after first"] = gc.isenabled()
        first_out.set()

    def second():
        first_in.wait(5)
        with graphs._no_collection():
            second_in.set()
            first_out.wait(5)
            seen["second, first done"] = gc.isenabled()

    assert gc.isenabled()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"after first": False, "second, first done": False}
    assert gc.isenabled()


def test_a_collector_turned_off_before_stays_off():
    gc.disable()
    try:
        with graphs._no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
