"""``python -m pdserve_sim``: the same as ``pdserve sim`` (used by the test helpers)."""

from pdserve_sim.cli import sim

if __name__ == "__main__":
    sim(prog_name="pdserve sim")
