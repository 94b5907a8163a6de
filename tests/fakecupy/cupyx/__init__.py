"""cupyx for the fake CuPy (tests only): pinned memory is plain host memory here."""
import numpy as np


def empty_pinned(shape, dtype=float):
    return np.empty(shape, dtype)
