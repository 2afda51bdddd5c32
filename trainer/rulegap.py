"""Kept for the old command line: `python -m memopd.trainer.rulegap` runs
`python -m memopd.trainer.experiments.rulegap` (trainer/experiments/rulegap.py), the module
that holds it now. Run by name, not imported: the trainer imports no experiment.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("memopd.trainer.experiments.rulegap", run_name="__main__", alter_sys=True)
