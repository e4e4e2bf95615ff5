"""The compact per-token layout of a step's rows (``rows``): the one vocabulary every room speaks.

May import: the packages outside the trainer only.
"""
