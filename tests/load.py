"""How loaded the machine is right now, for tests whose limits are wall-clock seconds. Not a test module.

`time_scale()` runs a busy loop for a fraction of a second and returns its wall time over its own CPU time: 1.0
when this process gets a whole core, about 1.5-2 with two busy processes per core beside it. A test multiplies the
slack of a wall-clock bound (process start-up, scheduling) by it, so the bound keeps its meaning on a busy machine
(the suite runs on two workers, CI machines are shared); what the bound is about (a timeout firing, work side by
side instead of one after another) stays asserted.
"""

from __future__ import annotations

import time


def time_scale(sample_s: float = 0.2) -> float:
    """Wall seconds per CPU second of a busy loop in this process (at least 1)."""
    wall, cpu = time.perf_counter(), time.process_time()
    while time.process_time() - cpu < sample_s:
        pass
    return max(1.0, (time.perf_counter() - wall) / max(time.process_time() - cpu, 1e-9))
