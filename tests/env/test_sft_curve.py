"""benchmarks/analysis/sft_curve.py: an SFT resume state becomes a checkpoint directory that
`memopd eval` loads, holding exactly the state's weights, in the world the run trains in."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "analysis"))


def test_snapshot_checkpoint_holds_the_states_weights(tmp_path):
    import sft_curve

    from memopd.env.qa.evaluate import load_agent_env
    from memopd.env.qa.sft import make_model, role_presets
    from memopd.env.qa.tokenizer import build_tokenizer
    from memopd.env.qa.world import World, world_preset

    wc = world_preset("replication", seed=0)
    specs, _ = role_presets(wc)
    tok = build_tokenizer(World.generate(wc).vocabulary_texts(), kind="word")
    model = make_model(specs["student"], tok, seed=3)  # weights unlike a fresh seed-0 model
    state = {"step": 123, "model": model.state_dict(), "ema_acc": 0.5, "ema_loss": 1.0}
    torch.save(state, tmp_path / "student.resume-sft.pt")
    step = sft_curve.snapshot_checkpoint(str(tmp_path / "student.resume-sft.pt"), str(tmp_path / "ckpt"),
                                         "replication", "student")
    assert step == 123
    loaded, tok2, env, world = load_agent_env(tmp_path / "ckpt")
    assert world.config == wc and len(tok2) == len(tok)
    for name, p in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], p), name
