"""PPO + on-policy distillation trainer of memopd (installed as `memopd.trainer`)."""
