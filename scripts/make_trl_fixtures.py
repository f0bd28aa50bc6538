"""Writes tests/fixtures/trl_gold.json: TRL GOLD's ULD losses (`trl.experimental.gold.ULDLoss`) on one fixed row of
two tokenizations, for tests/test_gold_conventions.py (the test suite itself needs neither torch nor TRL).

Run by hand, in an environment with TRL (it pulls transformers and needs torch):

    pip install torch==2.13.0 trl
    python scripts/make_trl_fixtures.py      # writes tests/fixtures/trl_gold.json

The row: the text "abc def" then an end-of-text token, as a student of single-byte tokens ("a", "b", "c", " ", "d",
"e", "f", EOS) and a teacher of longer ones ("abc", " d", "e", "f", EOS); random logits (float32) for each side.
In meshdistill's convention a row's ``logits[t]`` predict ``targets[t]``; TRL's model input is that row with one
prompt token first (label -100), so TRL's logits are meshdistill's plus one position after the last target
(``s_after`` / ``t_after``), which only the ``observed`` merge could read. TRL gets the completion's byte offsets
(the end-of-text token one byte, as meshdistill counts it) and, for the hybrid loss, two tokenizer stand-ins whose
vocabularies share exactly the token strings of the matched pairs ``matched_t`` / ``matched_s``.

Each case records TRL's settings, its loss (TRL averages the per-group terms over the groups it compares: ``groups``)
and, for the hybrid loss, its matched and unmatched terms. ``crossentropy_weight`` is 0: the distillation term alone.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "trl_gold.json"

VS, VT = 12, 20
S_EOS, T_EOS = 11, 19
S_PIECES = [b"a", b"b", b"c", b" ", b"d", b"e", b"f", None]  # None: end of text (one byte)
T_PIECES = [b"abc", b" d", b"e", b"f", None]
MATCHED_T = [1, 4, 5, 9, 13]
MATCHED_S = [0, 3, 7, 2, 10]

CASES = {  # name: TRL settings (GOLDConfig fields)
    "uld_bayesian": dict(uld_token_merge_strategy="bayesian", uld_skip_student_eos=False,
                         uld_skip_teacher_eos=False),
    "uld_bayesian_skip_eos_temperatures": dict(uld_token_merge_strategy="bayesian", uld_student_temperature=2.0,
                                               uld_teacher_temperature=0.5),
    "uld_bayesian_skip_teacher_eos_only": dict(uld_token_merge_strategy="bayesian", uld_skip_student_eos=False),
    "uld_observed": dict(uld_token_merge_strategy="observed"),
    "uld_observed_temperatures": dict(uld_token_merge_strategy="observed", uld_student_temperature=1.5,
                                      uld_teacher_temperature=1.0),
    "hybrid_bayesian_beta0": dict(uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=True, beta=0.0),
    "hybrid_bayesian_beta0.5": dict(uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=True, beta=0.5),
    "hybrid_bayesian_beta1": dict(uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=True, beta=1.0),
    "hybrid_observed_beta0.5_weights": dict(uld_token_merge_strategy="observed", uld_use_hybrid_loss=True, beta=0.5,
                                            uld_hybrid_matched_weight=0.7, uld_hybrid_unmatched_weight=0.3),
    "hybrid_observed_beta0.3_temperatures": dict(uld_token_merge_strategy="observed", uld_use_hybrid_loss=True,
                                                 beta=0.3, uld_student_temperature=0.7, uld_teacher_temperature=1.3),
}


class _Vocab:
  """A tokenizer stand-in: TRL's hybrid loss matches vocabularies by `get_vocab()` token strings."""

  def __init__(self, names):
    self._vocab = {n: i for i, n in enumerate(names)}

  def get_vocab(self):
    return dict(self._vocab)


def vocabularies():
  t_names, s_names = [f"t{i}" for i in range(VT)], [f"s{i}" for i in range(VS)]
  for m, (t, s) in enumerate(zip(MATCHED_T, MATCHED_S)):
    t_names[t] = s_names[s] = f"m{m}"
  return _Vocab(t_names), _Vocab(s_names)


def offsets(pieces):
  """``[(start, end)]`` byte offsets of each token (end of text: one byte)."""
  ends = np.cumsum([1 if p is None else len(p) for p in pieces])
  return np.stack([np.concatenate([[0], ends[:-1]]), ends], axis=1)


def make_row():
  rng = np.random.default_rng(67)
  s_targets = rng.integers(0, VS - 1, len(S_PIECES))
  t_targets = rng.integers(0, VT - 1, len(T_PIECES))
  s_targets[-1], t_targets[-1] = S_EOS, T_EOS
  s_logits = (rng.normal(size=(len(S_PIECES) + 1, VS)) * 2).astype(np.float32)  # the last: TRL's position after
  t_logits = (rng.normal(size=(len(T_PIECES) + 1, VT)) * 2).astype(np.float32)
  return s_targets.astype(np.int64), t_targets.astype(np.int64), s_logits, t_logits


def trl_case(settings, row):
  import torch
  from trl.experimental.gold import GOLDConfig
  from trl.experimental.gold.gold_trainer import ULDLoss

  s_targets, t_targets, s_logits, t_logits = row
  config = GOLDConfig(output_dir="/tmp/trl_gold_fixture", use_uld_loss=True, uld_crossentropy_weight=0.0,
                      report_to="none", use_cpu=True, bf16=False, **settings)
  t_vocab, s_vocab = vocabularies()
  loss_fn = ULDLoss(config, student_tokenizer=s_vocab, teacher_tokenizer=t_vocab)

  def side(targets, logits, pieces):
    ids = torch.tensor([[0, *targets.tolist()]])  # a prompt token, then the targets
    labels = ids.clone()
    labels[0, 0] = -100
    offs = torch.tensor(np.concatenate([[[0, 0]], offsets(pieces)])[None])
    return torch.tensor(logits[None]), labels, ids, offs

  s_l, s_lab, s_ids, s_off = side(s_targets, s_logits, S_PIECES)
  t_l, t_lab, t_ids, t_off = side(t_targets, t_logits, T_PIECES)
  loss = loss_fn(s_l, t_l, s_lab, t_lab, s_ids, t_ids, student_byte_offsets=s_off, teacher_byte_offsets=t_off)
  # the groups TRL compared: its own byte walk over the answer it kept
  s_n = len(S_PIECES) - int(loss_fn.skip_student_eos)
  t_n = len(T_PIECES) - int(loss_fn.skip_teacher_eos)
  groups = loss_fn._align_by_byte_offsets(offsets(S_PIECES)[:s_n].tolist(), offsets(T_PIECES)[:t_n].tolist())
  out = {"settings": settings, "loss": float(loss), "groups": sum(bool(s and t) for s, t in zip(*groups))}
  if loss_fn.use_hybrid_loss:
    out["matched"] = float(loss_fn.last_matched_loss)
    out["unmatched"] = float(loss_fn.last_unmatched_loss)
  return out


def main() -> None:
  import trl
  from trl.experimental.gold import GOLDConfig

  row = make_row()
  s_targets, t_targets, s_logits, t_logits = row
  defaults = GOLDConfig(output_dir="/tmp/trl_gold_fixture", report_to="none", use_cpu=True, bf16=False)
  data = {
      "made_by": f"scripts/make_trl_fixtures.py with trl {trl.__version__}",
      "trl_defaults": {k: getattr(defaults, k) for k in (
          "beta", "uld_token_merge_strategy", "uld_student_temperature", "uld_teacher_temperature",
          "uld_skip_student_eos", "uld_skip_teacher_eos", "uld_hybrid_matched_weight")},
      "student_pieces": [None if p is None else p.decode() for p in S_PIECES],
      "teacher_pieces": [None if p is None else p.decode() for p in T_PIECES],
      "student_eos": S_EOS, "teacher_eos": T_EOS,
      "s_targets": s_targets.tolist(), "t_targets": t_targets.tolist(),
      "s_logits": s_logits[:-1].tolist(), "s_after": s_logits[-1].tolist(),
      "t_logits": t_logits[:-1].tolist(), "t_after": t_logits[-1].tolist(),
      "matched_t": MATCHED_T, "matched_s": MATCHED_S,
      "cases": {name: trl_case(settings, row) for name, settings in CASES.items()},
  }
  OUT.write_text(json.dumps(data, indent=1) + "\n")
  print(f"wrote {OUT}")


if __name__ == "__main__":
  main()
