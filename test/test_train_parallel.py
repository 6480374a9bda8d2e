"""Training parallel action chunks (issue 22, vla.chunk_decode "parallel"): the block attention mask (a context
token never sees a slot, a slot sees every slot and the context, padding is never seen), the packed pass equal to
each sample alone, TorchStream's parallel chunk equal to the training pass on the same context (and to the numpy
engine's parallel decode on the same weights), the loss over the A bins with padded steps out of it, a CLI run
writing chunk_decode parallel, and an autoregressive checkpoint seeding a parallel run."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("rosbags")

from test_bag_io import write_demo_bag  # noqa: E402
from test_train_horizon import BUDGET, INSTRUCTION, P, TPF, dataset, images  # noqa: E402
from test_train_trainer import TINY  # noqa: E402
from vla_edge_ros.core.kv.manager import KVManager  # noqa: E402
from vla_edge_ros.engine import geometry  # noqa: E402
from vla_edge_ros.engine.checkpoint import write_checkpoint  # noqa: E402
from vla_edge_ros.engine.config import ModelConfig, tiny_default_dict  # noqa: E402
from vla_edge_ros.engine.factory import make_engine  # noqa: E402
from vla_edge_ros.train import cli  # noqa: E402
from vla_edge_ros.train.model import TorchStream, VLAPolicy, parallel_attention_mask  # noqa: E402
from vla_edge_ros.train.trainer import DeviceData, TrainConfig, batch_loss, evaluate, greedy_bins, train  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402


def tiny_cfg(horizon: int = 2, decode: str = "parallel", start: str = "token") -> ModelConfig:
    d = tiny_default_dict()
    d.update(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=64, tie_word_embeddings=True)
    d["vla"].update(patch_grid=[2, 4], patch_size=8, action_horizon=horizon, chunk_decode=decode,
                    action_start=start)
    return ModelConfig.from_json(d)


def test_the_mask_is_causal_context_then_bidirectional_slots_and_never_padding():
    ctx, A, L = torch.tensor([3, 5, 1]), 2, 8
    got = parallel_attention_mask(ctx, A, L)
    assert got.shape == (3, 1, L, L) and got.dtype == torch.bool
    for b, c in enumerate(ctx.tolist()):
        end = c + A
        m = got[b, 0]
        for q in range(end):  # every real token
            for k in range(L):
                want = k <= q if q < c else k < end
                assert bool(m[q, k]) is want, (b, q, k)
        assert not m[:c, c:].any()  # a context token never sees a slot
        assert m[c, end - 1]  # the first slot sees the last one
        assert not m[:end, end:].any()  # no real token sees a pad
        assert m[end:].any(dim=1).all()  # a pad row sees something (no all-masked softmax)


def test_context_rows_ignore_the_slots_and_slots_see_later_slots():
    """The same packed sequence through the decoder with the parallel mask and with a plain causal mask: the
    context rows are the same (they never see a slot), the first slot differs (it sees the later ones)."""
    cfg = tiny_cfg(2)
    policy = VLAPolicy(cfg).init_weights(0, std=0.1).eval()
    rng = np.random.default_rng(0)
    prefix = torch.as_tensor([list(INSTRUCTION.encode())])
    lens, counts = torch.tensor([P]), torch.tensor([2])
    frames = torch.as_tensor(rng.integers(0, 256, (2, 16, 32, 3)).astype(np.float32))
    A = geometry.chunk_action_tokens(cfg)
    slots = torch.full((1, A), geometry.parallel_slot_token(cfg))
    with torch.no_grad():
        x, pos, ctx = policy._packed_sequence(prefix, lens, frames, counts, slots, None)
        n = int(ctx[0])
        h_par, _ = policy.decoder(x, pos, mask=parallel_attention_mask(ctx, A, x.shape[1]))
        h_causal, _ = policy.decoder(x, pos)
    torch.testing.assert_close(h_par[0, :n], h_causal[0, :n], atol=1e-5, rtol=0)
    assert float((h_par[0, n] - h_causal[0, n]).abs().max()) > 1e-3


def test_packed_parallel_batch_is_each_sample_alone():
    """Prefixes of different lengths (one empty) and 1-3 frames: every sample gets the slot logits it gets alone
    (no padding), so padding is never seen and the index arithmetic puts each slot after its own context."""
    cfg = tiny_cfg(2)
    policy = VLAPolicy(cfg).init_weights(1, std=0.1).eval()
    rng = np.random.default_rng(3)
    texts = (INSTRUCTION, "", "go", "a b c d e")
    counts = [3, 1, 2, 1]
    lens = torch.tensor([len(t) for t in texts])
    prefix = torch.zeros(4, int(lens.max()), dtype=torch.long)
    for b, t in enumerate(texts):
        prefix[b, :len(t)] = torch.as_tensor(list(t.encode()), dtype=torch.long)
    frames = torch.as_tensor(rng.integers(0, 256, (sum(counts), 16, 32, 3)).astype(np.float32))
    starts = np.cumsum([0] + counts)
    with torch.no_grad():
        together = policy.parallel_logits(prefix, lens, frames, torch.tensor(counts))
        assert together.shape == (4, 14, cfg.n_action_bins)
        for b in range(4):
            alone = policy.parallel_logits(prefix[b:b + 1, :max(1, len(texts[b]))], lens[b:b + 1],
                                           frames[starts[b]:starts[b + 1]], torch.tensor(counts[b:b + 1]))
            torch.testing.assert_close(together[b], alone[0], atol=1e-5, rtol=0)
        swapped = policy.parallel_logits(prefix.flip(0), lens.flip(0), frames, torch.tensor(counts[::-1]))
    assert float((swapped[3] - together[0]).abs().max()) > 1e-3  # a wrong frame assignment would show
    assert float((together[0, 0] - together[0, 1]).abs().max()) > 1e-3  # same input id: slots differ by position


def test_torch_stream_parallel_is_the_training_pass_on_the_same_context():
    """No eviction yet: the streaming chunk's context is the sample with the whole episode so far, so its slot
    logits and bins are parallel_logits' (and trainer.greedy_bins' one pass) on that sample."""
    ds, eps = dataset(2, max_past=3)
    cfg = tiny_cfg(2)
    policy = VLAPolicy(cfg).init_weights(0, std=0.1).eval()
    data = DeviceData(ds, torch.device("cpu"), TPF)
    stream = TorchStream(policy, KVManager(BUDGET + 4 * TPF, TPF, P, "fifo", embed_dim=32), INSTRUCTION)
    assert stream.decode_steps == geometry.chunk_decode_steps(cfg, 8) == 1
    off, A = cfg.action_token_offset, 14
    chunks = set()
    for t in range(4):
        s = stream.run_chunk(stream.encode_frame(eps[1].frames[t]), t)
        b = data.batch(ds.rows(np.array([[1, t]]), t, None, augment=False))
        with torch.no_grad():
            logits = policy.parallel_logits(b.prefix_ids, b.prefix_lens, b.frames, b.frame_counts)[0].numpy()
        assert s["logits"].shape == (A + 1, 256) and len(s["token_ids"]) == A + 1  # gen[0] + the A slots
        np.testing.assert_allclose(s["logits"][1:], logits, atol=1e-4)
        assert (s["token_ids"][1:] - off).tolist() == logits.argmax(-1).tolist() == greedy_bins(policy, b)[0].tolist()
        assert s["chunk_bins"].tolist() == logits.argmax(-1).reshape(2, 7).tolist()
        assert s["chunk"].shape == (2, 7) and np.array_equal(s["chunk"][0], s["action"])
        chunks.add(tuple(s["chunk_bins"].ravel()))
    assert len(chunks) > 1  # frames matter: not a constant output
    with pytest.raises(ValueError, match="action_start token"):
        TorchStream(VLAPolicy(tiny_cfg(1, start="prefill")), KVManager(BUDGET, TPF, P, "fifo", embed_dim=32),
                    INSTRUCTION)


def test_torch_stream_parallel_equals_the_numpy_engine(tmp_path):
    """The same tensors, a parallel H = 2 checkpoint, through eviction: NumpyEngine's parallel decode gives the
    tokens TorchStream gives (gen[0] from the prefill, then the 14 slots)."""
    cfg = tiny_cfg(2)
    policy = VLAPolicy(cfg).init_weights(2, std=0.1).eval()
    write_checkpoint(tmp_path, cfg.to_dict(), policy.export_tensors(), dtype="float32")
    eng = make_engine({"backend": "numpy", "checkpoint": str(tmp_path), "instruction": INSTRUCTION,
                       "tokens_per_frame": TPF, "kv_budget_tokens": BUDGET, "eviction_policy": "fifo"},
                      log=lambda m: None)
    problem = eng.chunk_support_problem()
    if problem:
        pytest.skip(f"the numpy engine does not decode vla.chunk_decode parallel yet: {problem}")
    stream = TorchStream(policy, KVManager(BUDGET, TPF, P, "fifo", embed_dim=32), INSTRUCTION)
    evicted = 0
    for f, img in enumerate(images(6, seed=3)):
        tokens = eng.encode_frame(img)
        r, s = eng.run_chunk(tokens, f), stream.run_chunk(tokens, f)
        assert stream.kv.frames == eng.kv.frames
        assert r.token_ids.tolist() == s["token_ids"].tolist()
        scale = float(np.abs(eng.last_logits).max())
        np.testing.assert_allclose(s["logits"], eng.last_logits, atol=1e-4 * scale)
        assert np.asarray(r.chunk_bins).tolist() == s["chunk_bins"].tolist()
        np.testing.assert_allclose(r.chunk, s["chunk"])
        evicted += len(r.evicted_frames)
    assert evicted >= 2  # positions were renumbered along the way


def test_the_loss_is_over_the_bins_and_padded_steps_do_not_count():
    ds, _ = dataset(3)
    cfg = tiny_cfg(3)
    policy = VLAPolicy(cfg).init_weights(0, std=0.1)
    data = DeviceData(ds, torch.device("cpu"), TPF)
    rows = ds.rows(np.array([[0, 3], [0, 2], [1, 1]]), 1, None, augment=False)
    b = data.batch(rows)
    with torch.no_grad():
        loss, logits, targets = batch_loss(policy, b)
        assert logits.shape == (3, 21, 256) and targets.tolist() == b.targets[:, 1:-1].tolist()  # no START / END
        mask = b.target_mask[:, 1:-1]
        assert not mask.all() and mask.any()
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1), reduction="none")
        assert float(loss) == pytest.approx(float(ce[mask.reshape(-1)].mean()), rel=1e-6)
        assert float(loss) != pytest.approx(float(ce.mean()), rel=1e-3)  # the mask matters here
        b.targets[0, 1:-1][~mask[0]] = (b.targets[0, 1:-1][~mask[0]] + 50) % 256  # padded steps' bins
        b.targets[:, 0], b.targets[:, -1] = 9, 17  # START and END are not parallel targets
        assert float(batch_loss(policy, b)[0]) == float(loss)
        b.targets[2, 1] = (b.targets[2, 1] + 50) % 256  # an unpadded bin counts
        assert float(batch_loss(policy, b)[0]) != pytest.approx(float(loss), rel=1e-6)
    ev = evaluate(policy, data, [rows])
    assert ev["chunk_decode"] == "parallel" and ev["start_end_acc"] is None
    assert ev["padded_steps"] == 3 and ev["samples"] == 3  # (0, 3): 2 padded steps; (0, 2): 1
    assert evaluate(policy, data, [rows], greedy=True)["action_token_acc"] == ev["action_token_acc"]  # one pass
    with pytest.raises(ValueError, match="disagree on H"):
        batch_loss(VLAPolicy(tiny_cfg(2)).init_weights(0), b)


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    path = tmp_path_factory.mktemp("bags") / "demo"
    write_demo_bag(path, episodes=6, steps=12, hw=(16, 32))
    return path


CLI_TINY = ["--hidden", "32", "--layers", "2", "--intermediate", "64", "--patch-grid", "2", "4", "--patch-size",
            "8", "--batch-size", "4", "--threads", "1", "--no-progress", "--eval-samples", "16"]


def test_a_parallel_run_writes_chunk_decode_and_learns(bag, tmp_path, capsys):
    rc = cli.main([str(bag), "--out", str(tmp_path / "p2"), "--steps", "20", "--lr", "3e-3", "--warmup-steps",
                   "2", "--eval-every", "10", "--action-horizon", "2", "--chunk-decode", "parallel", *CLI_TINY])
    assert rc == 0, capsys.readouterr().err
    on_disk = json.loads((tmp_path / "p2" / "config.json").read_text())
    assert on_disk["vla"]["chunk_decode"] == "parallel" and on_disk["vla"]["action_horizon"] == 2
    assert ModelConfig.from_json(tmp_path / "p2").chunk_decode == "parallel"
    rec = json.loads((tmp_path / "p2" / "training_record.json").read_text())
    losses = rec["losses"]
    assert len(losses) == 20 and np.all(np.isfinite(losses)) and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert rec["context"]["decode_targets"] == {"chunk_decode": "parallel", "slot_token": 256, "rows": 14,
                                                "action_horizon": 2}
    assert rec["deploy"]["chunk_decode"] == "parallel" and rec["deploy"]["decode_steps"] == 1
    g = rec["figures"]["heldout"]["greedy"]
    assert g["chunk_decode"] == "parallel" and len(g["action_token_acc_varying_dims_per_step"]) == 2
    assert g["padded_steps"] > 0 and g["start_end_acc"] is None
    with pytest.raises(ValueError, match="chunk_decode must be one of"):
        train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "x"), steps=1, chunk_decode="oft", **TINY),
              log=lambda m: None)


def test_an_autoregressive_checkpoint_initialises_a_parallel_run(bag, tmp_path, capsys):
    train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "ar"), steps=5, seed=0, **TINY), log=lambda m: None)
    assert ModelConfig.from_json(tmp_path / "ar").chunk_decode == "autoregressive"
    for name, horizon in (("p1", "1"), ("p2", "2")):  # the same H, and H 1 -> 2 as well
        rc = cli.main([str(bag), "--out", str(tmp_path / name), "--steps", "1", "--lr", "0", *CLI_TINY,
                       "--action-horizon", horizon, "--chunk-decode", "parallel",
                       "--init-checkpoint", str(tmp_path / "ar")])
        assert rc == 0, capsys.readouterr().err
        assert ModelConfig.from_json(tmp_path / name).chunk_decode == "parallel"
        w0, w1 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("ar", name))
        assert set(w0) == set(w1) and all(np.array_equal(w0[k], w1[k]) for k in w0)  # lr 0: the load is exact
    with pytest.raises(ValueError, match="config differs.*intermediate_size"):  # other geometry: still refused
        train(TrainConfig(bags=[str(bag)], out=str(tmp_path / "x"), steps=1, chunk_decode="parallel",
                          init_checkpoint=str(tmp_path / "ar"), **{**TINY, "intermediate": 96}), log=lambda m: None)
