"""A gym-style text game: guess a number from 1 to ``high``, told "higher" or "lower" after each try.

``reset() -> observation``; ``step(action) -> (observation, reward, done, info)``. Reward 1.0 on the
right guess (the episode ends), 0.0 otherwise; a reply without a number is a wasted try.
"""

from __future__ import annotations

import re


class GuessNumber:
    def __init__(self, target: int, high: int = 10):
        if not 1 <= target <= high:
            raise ValueError(f"target: {target} is not in 1..{high}")
        self.target, self.high, self.guesses = target, high, []

    def reset(self) -> str:
        return f"I am thinking of a number from 1 to {self.high}. Guess it: reply with one number."

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        m = re.search(r"-?\d+", action)
        if m is None:
            return "Reply with one number.", 0.0, False, {"guess": None}
        guess = int(m.group(0))
        self.guesses.append(guess)
        if guess == self.target:
            return "Correct!", 1.0, True, {"guess": guess}
        return ("Higher." if guess < self.target else "Lower."), 0.0, False, {"guess": guess}
