from kvcentric.runtime.transfer import TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_goes_at_once_then_the_rate_holds():
    clock = FakeClock()
    bucket = TokenBucket(rate_bytes_s=1000, burst_bytes=500, clock=clock)
    assert bucket.delay_for(500) == 0.0
    assert bucket.delay_for(1000) == 1.0  # 1000 bytes more at 1000 B/s
    clock.now = 1.0
    assert bucket.delay_for(1000) == 1.0  # still 1000 in debt after one second's credit
    clock.now = 10.0
    assert bucket.delay_for(100) == 0.0  # credit refills, capped at the burst
