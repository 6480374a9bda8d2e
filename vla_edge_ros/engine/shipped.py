"""Trained policies shipped inside the package, addressed by name (``checkpoint:=metaworld_mt3``).

Why ship one: every other checkpoint of this project is either random (the embedded tiny default) or lives in
a git-ignored ``results/`` folder that a new checkout does not have, so a user could not run the closed loop
with a policy that works without first training one on a GPU. The shipped policy is the product of a recorded
command (``tools/train_policy/run.sh``, its ``training_record.json`` says which), small enough for git
(4.77 M parameters in bfloat16, 9.5 MB), committed once when final.

A name resolves only when no file or directory of that name exists, so a directory a user made always wins;
``manifest.json`` holds the SHA-256 of the weights, and a copy that does not match it is refused by name (a
shipped file changed by hand or truncated by an install must not run on a robot as if it were the trained one).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from vla_edge_ros.engine.tiny_default import sha256_of

POLICIES_DIR = Path(__file__).resolve().parent.parent / "policies"
MANIFEST = "manifest.json"


class ShippedPolicyError(ValueError):
    pass


def shipped_names() -> list[str]:
    if not POLICIES_DIR.is_dir():
        return []
    return sorted(p.name for p in POLICIES_DIR.iterdir() if (p / MANIFEST).is_file())


def shipped_policy(name: str) -> Optional[Path]:
    """The directory of shipped policy ``name``, None when there is none of that name; verified against its
    manifest (ShippedPolicyError when a file does not match)."""
    if not name or "/" in name or name.startswith("."):
        return None
    d = POLICIES_DIR / name
    if not (d / MANIFEST).is_file():
        return None
    manifest = json.loads((d / MANIFEST).read_text(encoding="utf-8"))
    for fname, want in manifest["sha256"].items():
        f = d / fname
        if not f.is_file():
            raise ShippedPolicyError(f"shipped policy {name}: {fname} is missing from {d}")
        got = sha256_of(f)
        if got != want:
            raise ShippedPolicyError(f"shipped policy {name}: {fname} has SHA-256 {got[:12]}..., the manifest "
                                     f"says {want[:12]}...; reinstall the package")
    return d


def resolve(checkpoint: str) -> Path:
    """A checkpoint parameter -> its path: the path itself when anything exists there, else the shipped policy
    of that name (the one rule for the runtime, the demo and the eval). ShippedPolicyError when it is neither."""
    path = Path(checkpoint).expanduser()
    if path.exists():
        return path
    named = shipped_policy(checkpoint)
    if named is not None:
        return named
    names = shipped_names()
    raise ShippedPolicyError(f"checkpoint {path}: no such directory"
                             + (f", nor a shipped policy ({', '.join(names)})" if names else ""))
