"""Divisibility, the rule behind every split of a size over ranks: `divisors(n)` for the hints
of validation errors, and `check_divides`, the one check that a degree splits a list of sizes."""

from collections.abc import Iterable

from interlace.errors import PlanError


def divisors(n: int) -> list[int]:
    """Every positive divisor of `n` (n >= 1), ascending: divisors(12) = [1, 2, 3, 4, 6, 12]."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(degree: int, what: str, sizes: Iterable[tuple[str, int]]) -> None:
    """PlanError naming the first (name, size) of `sizes` that `degree` does not divide, e.g.
    "n_heads=6 is not divisible by the tensor parallel degree 4; use a degree in [1, 2, 3, 6]"
    (`what` = "tensor parallel degree")."""
    for name, size in sizes:
        if size % degree:
            raise PlanError(
                f"{name}={size} is not divisible by the {what} {degree}; use a degree in "
                f"{divisors(size)[:8]}"
            )
