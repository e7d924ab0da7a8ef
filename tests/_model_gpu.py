"""A model GPU for the benchmark's timing functions on the CPU (tests only)."""

from __future__ import annotations

from cugrouped.bench import common


class ModelGPU:
    """The timing functions' device calls on a model GPU (``common._event_pair`` & co.): a
    clock in ms that the spin kernel and the work advance; ``sag`` slows the work down as the
    clock runs (a GPU that heats up: each ms of work takes ``1 + sag * t`` ms at time ``t``)."""

    def __init__(self, monkeypatch, sag: float = 0.0):
        self.t, self.sag, self.calls = 0.0, sag, []
        gpu = self

        class Event:
            def record(self):
                self.t = gpu.t

        monkeypatch.setattr(common, "spin", lambda ns: setattr(self, "t", self.t + ns / 1e6))
        monkeypatch.setattr(common, "_synchronize", lambda: None)
        monkeypatch.setattr(common, "_event_pair", lambda: (Event(), Event()))
        monkeypatch.setattr(common, "_elapsed_ms", lambda start, stop: stop.t - start.t)

    def work(self, name: str, ms: float):
        def fn(i):
            self.calls.append((name, i))
            self.t += ms * (1 + self.sag * self.t)
        return fn

