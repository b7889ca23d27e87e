"""Work run on a thread of its own that ends with it.

On the CPU backend torch runs its parallel ops in an OpenMP team that stays with the thread that started it, and
libgomp stops spin-waiting between ops (its workers sleep and wake at each one) once more threads sit in teams than
there are cores. Loading and building a model start such a team; on the thread that goes on serving (the event
loop's) it would sit idle beside the stream threads' for the worker's life. Run there, the team ends with the
work: SmolLM2-135M's decode step on the 2-core development VM took 33-36 ms with the build's team alive, 15.6 ms
without."""

import threading
from typing import Callable, TypeVar

Result = TypeVar("Result")


def run_on_own_thread(work: Callable[[], Result], name: str = "build") -> Result:
    """work()'s result, or its exception raised here, work having run on a new thread (a daemon: a signal that ends
    the process while it runs does not wait for it)."""
    outcome: list = []

    def target():
        try:
            outcome.append((True, work()))
        except BaseException as error:          # handed to the caller, as if work had run there
            outcome.append((False, error))

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    thread.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value
