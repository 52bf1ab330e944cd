"""Schedule IR: the data model (program.py), the op set (ops.py), and its text and JSON forms."""

from ir.program import (
    IR_VERSION, Bound, Buffer, Counter, Range, Region, ScheduleProgram, Signal, Target, Task,
    Wait, WeightSource,
)
from ir.ops import OPS, OpSpec
from ir.text import IRParseError, format_program, parse_program
from ir.jsonio import IRJsonError, program_from_json, program_to_json
from ir.io import load_program, save_program

__all__ = [
    "IR_VERSION", "Bound", "Buffer", "Counter", "Range", "Region", "ScheduleProgram", "Signal",
    "Target", "Task", "Wait", "WeightSource", "OPS", "OpSpec",
    "IRParseError", "format_program", "parse_program", "IRJsonError", "program_from_json",
    "program_to_json", "load_program", "save_program",
]
