"""The paper's experiments, run on top of the trainer (installed as `memopd.trainer.experiments`).

They import the trainer and the environment; nothing outside this folder imports them
(`memopd compare --protocol NAME` finds its module by name: trainer/compare.py, `PROTOCOLS`).

- `paper`, `infogap_protocol`: the paper protocol and the info-gap protocol (`memopd compare
  --protocol paper|info-gap`); `runs`: the reading of their runs and `--publish DIR`;
- `intervals`: the statistics they report (paired bootstrap, t intervals, the minimal
  detectable effect, curve areas);
- `manipulation`: the info-gap manipulation check (does the teacher's view change its
  top-1?), `python -m memopd.trainer.experiments.manipulation`;
- `infogap_world`: the info-gap world (`InfoGapWorldConfig`: information-gap sets and
  per-set turn budgets), the "info-gap" world preset, which the product reads by name;
- `infogap_sft`: the info-gap teacher's SFT recipe (`InfoGapSFTConfig`, a `memopd sft`
  recipe) and the info-gap world's role presets, which `memopd sft --world info-gap` reads;
- `infogap_expert`: the rational expert rule (reads every visible fact), the "rational"
  expert the product's `make_expert` reads by name, and the per-set call count it needs;
- `infogap`: the info-gap measures (information-gap calls, the views' disagreement ceiling,
  the role of each action token);
- `rulegap`, `ruleteacher`: the rule-teacher replication (an exact-reader teacher),
  `python -m memopd.trainer.experiments.rulegap`.
"""
