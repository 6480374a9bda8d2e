"""vla_edge_ros.train: behaviour cloning of this package's checkpoint format from bags (issue 21, part 3).

The only place torch is imported (the optional ``train`` extra); the runtime never imports this package.

- dataset.py  episodes from bags (data/bag_reader.py) -> the contexts the runtime builds at inference: pinned
              instruction prefix + retained past frames + current frame -> action tokens (numpy, no torch);
- model.py    the torch Qwen2 + patch embedder mirroring engine/reference.py, under the checkpoint's HF tensor
              names, with a streaming chunk that mirrors reference_chunk (what the tests hold to NumpyEngine);
- trainer.py  teacher-forced cross-entropy, held-out accuracy, checkpoint + loss curve + training record;
- cli.py      ``vla_train`` (also ``python -m vla_edge_ros.train``).
"""
