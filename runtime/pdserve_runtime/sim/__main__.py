"""``python -m pdserve_runtime.sim``: the same as ``pdserve sim`` (used by the test helpers)."""

from pdserve_runtime.sim.cli import sim

if __name__ == "__main__":
    sim(prog_name="pdserve sim")
