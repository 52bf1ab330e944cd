"""Static safety checks of schedule programs: ``validate(program) -> Verdict``.

See docs/validator.md for the checks, the error classes and their witnesses.
"""

from validator.verdict import Finding, Verdict
from validator.validate import validate

__all__ = ["validate", "Verdict", "Finding"]
