"""A monotonic nanosecond clock that moves only when a test moves it (the loops' injectable ``clock``)."""
MS = 1_000_000


class FakeClock:
    def __init__(self, t_ns: int = 1_000 * MS):
        self.t = t_ns

    def __call__(self) -> int:
        return self.t

    def advance_ms(self, ms: float) -> None:
        self.t += int(round(ms * MS))
