"""p2p.ratelimit: the token bucket behind the relay's budgets and the NAT protocols' per-source limits."""

from __future__ import annotations

from p2p.ratelimit import RateLimiter, TokenBucket


def test_bucket_starts_full_refills_at_rate_and_saves_at_most_burst():
    """A full bucket spends its burst, refills rate tokens a second, and never holds more than burst."""
    b = TokenBucket.full(rate=2.0, burst=3.0, now=0.0)
    assert [b.take(1.0, 0.0) for _ in range(4)] == [True, True, True, False]
    assert b.take(1.0, 0.5)  # 0.5 s at 2/s: one token back
    assert not b.take(1.0, 0.5)
    b.refill(100.0)
    assert b.tokens == 3.0


def test_a_take_larger_than_the_tokens_spends_nothing():
    """take(n) is all or nothing."""
    b = TokenBucket.full(rate=1.0, burst=10.0, now=0.0)
    assert not b.take(11.0, 0.0)
    assert b.tokens == 10.0
    assert b.take(10.0, 0.0)
    assert b.tokens == 0.0


def test_time_going_backwards_refills_nothing():
    """A refill at an earlier time than the last leaves the bucket as it was."""
    b = TokenBucket(rate=1.0, burst=5.0, tokens=1.0, updated=10.0)
    b.refill(9.0)
    assert (b.tokens, b.updated) == (1.0, 10.0)


def test_limiter_keeps_one_bucket_per_key():
    """Each key has its own burst; one key running dry does not limit another."""
    limiter = RateLimiter(rate=1.0, burst=2.0)
    assert [limiter.allow("a", 0.0) for _ in range(3)] == [True, True, False]
    assert limiter.allow("b", 0.0)
    assert limiter.allow("a", 1.0)


def test_limiter_forgets_the_least_recently_used_key_past_max_keys():
    """Past max_keys the oldest key is dropped, so it starts full again; a recently used one is kept."""
    limiter = RateLimiter(rate=0.0, burst=1.0, max_keys=2)
    assert limiter.allow("a", 0.0) and limiter.allow("b", 0.0)
    assert not limiter.allow("a", 0.0)  # a is now the most recent
    assert limiter.allow("c", 0.0)  # evicts b
    assert limiter.allow("b", 0.0)  # b forgotten: full again (evicts a)
    assert limiter.allow("a", 0.0)
