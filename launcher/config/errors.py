"""The errors a config that cannot work raises: each names the key at fault, the problem and the fix.
The rule table (launcher.config.rules) makes them; compose, submit, plan and the CLI print them."""
from __future__ import annotations

from typing import List


class ConfigError(ValueError):
    """A config value that cannot work. Carries the key so the message can name it."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"{key}: {problem}\n  fix: {fix}")

    def __reduce__(self):  # pickled back as it was (a job's result may carry it)
        return (ConfigError, (self.key, self.problem, self.fix))


class ConfigErrors(ValueError):
    """Several ConfigErrors found at once (every rule is checked before reporting)."""

    def __init__(self, errors: List[ConfigError], where: str = ""):
        self.errors = errors
        head = f"invalid config{(' ' + where) if where else ''}"
        super().__init__(head + ":\n" + "\n".join(f"- {e}" for e in errors))
        self.where = where

    def __reduce__(self):  # pickled back as it was (a job's result may carry it)
        return (ConfigErrors, (self.errors, self.where))
