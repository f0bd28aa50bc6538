"""The reasoning-trace flow on the chat fixture (docs/chat.md): `meshdistill generate --model teacher --prompts-file
CONVERSATIONS --out TRACES` writes conversations whose last turn is the teacher's reply, and `data.source: TRACES`
trains on that reply from the first token after the prompt the teacher was given (the template's generation prompt
included), to its end-of-turn token."""

import json
import pathlib

import numpy as np
import pytest

pytest.importorskip("transformers")

from meshdistill.cli import main  # noqa: E402
from meshdistill.config import load_config  # noqa: E402
from meshdistill.data import build_data, chat  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "chat.yaml")


def test_teacher_traces_become_the_assistant_turns_trained_on(tmp_path, capsys):
  rows = [json.loads(line) for line in (ROOT / "examples" / "data" / "chat.jsonl").read_text().splitlines()[:4]]
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"messages": r["messages"][:-1]}) + "\n" for r in rows))
  traces = tmp_path / "traces.jsonl"
  sets = ["--set", f"run.run_dir={tmp_path / 'run'}"]  # the config's 2 x 4 mesh of the suite's 8 CPU devices
  code = main(["generate", "--config", CONFIG, *sets, "--model", "teacher", "--prompts-file", str(prompts),
               "--max-new-tokens", "12", "--temperature", "0", "--out", str(traces)])
  assert code == 0, capsys.readouterr().err
  assert f"wrote 4 records to {traces}" in capsys.readouterr().out
  records = [json.loads(line) for line in traces.read_text().splitlines()]
  assert [r["messages"][:-1] for r in records] == [r["messages"][:-1] for r in rows]  # the prompts, as given
  assert all(r["messages"][-1]["role"] == "assistant" for r in records)

  cfg = load_config(CONFIG, [f"data.source={traces}", "data.val_fraction=0"])
  data = build_data(cfg.data, 4, process_index=0, process_count=1)
  tok = chat.load_chat_tokenizer(cfg.data.tokenizer)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  assert data.tokenizer.eos_id == im_end  # on-policy sampling of these rows stops at the end of the turn
  for i, r in enumerate(records):
    asked = chat.prompt_ids(tok, r["messages"][:-1])
    row = data.train.rows([i])
    n = int(data.train.lengths[i])
    assert row["prompt_len"][0] == len(asked)
    np.testing.assert_array_equal(data.train.tokens[i, : len(asked)], asked)  # the prompt as the teacher saw it
    mask = row["mask"][0, : n - 1]  # target t is token t + 1
    end = int(np.flatnonzero(data.train.tokens[i, :n] == im_end)[-1])  # the reply's end of turn
    assert end >= len(asked) and mask[len(asked) - 2] == 0
    assert np.all(mask[len(asked) - 1 : end] == 1) and not mask[end:].any()  # the reply and its end, nothing after
