"""The ground floor: errors, timing and file helpers every other package may import.

Nothing here imports from amk's other packages (ir, models, lowering, validator, search, amk).
"""
