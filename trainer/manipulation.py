"""Kept for the old command line: `python -m memopd.trainer.manipulation` runs
`python -m memopd.trainer.experiments.manipulation` (trainer/experiments/manipulation.py), the module
that holds it now. Run by name, not imported: the trainer imports no experiment.
"""
import runpy

if __name__ == "__main__":
    runpy.run_module("memopd.trainer.experiments.manipulation", run_name="__main__", alter_sys=True)
