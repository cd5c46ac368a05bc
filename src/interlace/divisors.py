"""`divisors(n)`: the one helper behind every "use a value in [...]" hint of a validation error."""


def divisors(n: int) -> list[int]:
    """Every positive divisor of `n` (n >= 1), ascending: divisors(12) = [1, 2, 3, 4, 6, 12]."""
    return [d for d in range(1, n + 1) if n % d == 0]
