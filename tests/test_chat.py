"""Conversational data (`meshdistill.data.chat`, `meshdistill.data._records`): token ids and assistant-only loss masks
equal to transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)``, with and without
``{% generation %}`` markers, on the Qwen3 fixture's tokenizer (ChatML) and a Llama-3-style template; the named
errors; prompt/completion records; the shipped chat config's data. No JAX: tokenizers and transformers only."""

import json
import pathlib
import shutil

import numpy as np
import pytest

from meshdistill.data import DataConfig, build_data
from meshdistill.data import chat
from meshdistill.data._records import resolve_format

transformers = pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parents[1]
QWEN3 = ROOT / "tests" / "fixtures" / "hf_qwen3"
CHAT_FILE = ROOT / "examples" / "data" / "chat.jsonl"

# The fixture's ChatML template (tests/fixtures/hf_qwen3/chat_template.jinja) with the assistant's reply and its
# end-of-turn token inside a generation block: it renders the same text.
CHATML_MARKED = (
    "{%- for message in messages %}{%- if message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{- '\\n' }}{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Llama 3's template (BOS, role headers, `| trim`, <|eot_id|> ends a turn), and the same with markers.
LLAMA3 = (
    "{%- for message in messages %}{%- set content = '<|start_header_id|>' + message['role']"
    " + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}{%- if loop.index0 == 0 %}{%- set content = bos_token + content %}"
    "{%- endif %}{{- content }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_MARKED = (
    "{%- for message in messages %}{%- if loop.index0 == 0 %}{{- bos_token }}{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CONVERSATIONS = [
    [{"role": "user", "content": "Repeat: the student learns"}, {"role": "assistant", "content": "the student learns"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Count: weights are split"}, {"role": "assistant", "content": "3 words"},
     {"role": "user", "content": "Reverse: a small model"}, {"role": "assistant", "content": " model small a "},
     {"role": "user", "content": "Repeat: every token"}, {"role": "assistant", "content": "every token"}],
    [{"role": "user", "content": "Repeat: it"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "it"}],
]


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _template_file(tmp_path, text, name="marked.jinja"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _reference(folder, template, messages):
  """transformers' own ids and assistant mask with a marked ``template``."""
  tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
  out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
  return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"])


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
  """The Qwen3 fixture's tokenizer.json with Llama 3's special tokens added, and Llama 3's template (unmarked)."""
  from tokenizers import Tokenizer

  folder = tmp_path_factory.mktemp("llama3_style")
  tok = Tokenizer.from_file(str(QWEN3 / "tokenizer.json"))
  tok.add_special_tokens(LLAMA3_SPECIAL)
  tok.save(str(folder / "tokenizer.json"))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
            "pad_token": "<|endoftext|>", "chat_template": LLAMA3}
  (folder / "tokenizer_config.json").write_text(json.dumps(config))
  return folder


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "three_turns_system", "empty_reply"])
def test_marked_template_rows_equal_transformers_ids_and_assistant_masks(tmp_path, messages):
  """Through the whole data pipeline (records -> rows): the row's tokens are transformers' ids and its loss mask on
  the targets is transformers' assistant mask shifted by one (target t is token t + 1)."""
  data = _jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
  cfg = DataConfig(source=str(data), tokenizer=str(QWEN3), chat_template=_template_file(tmp_path, CHATML_MARKED),
                   val_fraction=0.0, seq_len=128)
  rows = build_data(cfg, 1, process_index=0, process_count=1).train
  ids, mask = _reference(QWEN3, CHATML_MARKED, messages)
  assert mask.sum() > 0
  n = len(ids)
  batch = rows.rows([0])
  np.testing.assert_array_equal(batch["inputs"][0, :n - 1], ids[:-1])
  np.testing.assert_array_equal(batch["targets"][0, :n - 1], ids[1:])
  np.testing.assert_array_equal(batch["mask"][0, :n - 1], mask[1:])
  assert batch["mask"][0, n - 1:].sum() == 0  # padding never counts
  # the on-policy prompt ends where the last assistant reply starts
  assert batch["prompt_len"][0] == np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)[-1]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "three_turns_system", "empty_reply"])
def test_prefix_rendering_gives_the_marked_templates_masks_chatml(messages):
  """The fixture's own template has no markers (as Qwen's): rendering prefixes finds the same tokens as the marked
  version of it, the end-of-turn token in, the newline after it out."""
  tok = chat.load_chat_tokenizer(str(QWEN3))
  assert not chat.has_generation_markers(tok.chat_template)
  got = chat.render(tok, messages)
  ids, mask = _reference(QWEN3, CHATML_MARKED, messages)
  np.testing.assert_array_equal(got.ids, ids)
  np.testing.assert_array_equal(got.mask, mask)
  im_end = tok.convert_tokens_to_ids("<|im_end|>")
  assert all(got.mask[i] == 1 for i in np.flatnonzero(got.ids == im_end) if i > got.prompt_len)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["one_turn", "three_turns_system", "empty_reply"])
def test_prefix_rendering_gives_the_marked_templates_masks_llama3(llama3_dir, messages):
  tok = chat.load_chat_tokenizer(str(llama3_dir))
  got = chat.render(tok, messages)
  ids, mask = _reference(llama3_dir, LLAMA3_MARKED, messages)
  np.testing.assert_array_equal(got.ids, ids)
  np.testing.assert_array_equal(got.mask, mask)
  assert got.ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
  eot = tok.convert_tokens_to_ids("<|eot_id|>")
  assert got.mask[-1] == 1 and got.ids[-1] == eot  # the reply's end-of-turn token is trained


def test_a_template_that_rewrites_earlier_turns_is_refused_by_name(tmp_path):
  """Like Qwen3's (earlier replies lose their reasoning once a later turn follows): prefixes cannot find the tokens."""
  drops = ("{%- for m in messages %}{%- if m['role'] == 'assistant' and not loop.last %}"
           "{{- '<|im_start|>assistant\\n<|im_end|>\\n' }}{%- else %}"
           "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
           "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
  tok = chat.load_chat_tokenizer(str(QWEN3), _template_file(tmp_path, drops, "drops.jinja"))
  chat.render(tok, CONVERSATIONS[0])  # one reply: nothing is rewritten
  with pytest.raises(chat.TemplateNotPrefixPreserving, match=r"generation %\} / \{% endgeneration"):
    chat.render(tok, CONVERSATIONS[1])


def test_a_tokenizer_without_a_template_is_a_named_error(tmp_path):
  bare = tmp_path / "bare"
  bare.mkdir()
  shutil.copy(QWEN3 / "tokenizer.json", bare / "tokenizer.json")
  data = _jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
  with pytest.raises(chat.NoChatTemplate, match=r"data.chat_template"):
    build_data(DataConfig(source=str(data), tokenizer=str(bare), val_fraction=0.0), 1, process_index=0,
               process_count=1)
  with pytest.raises(chat.NoChatTemplate, match=r"data.tokenizer='byte'"):
    build_data(DataConfig(source=str(data), val_fraction=0.0), 1, process_index=0, process_count=1)


def test_a_conversation_ending_with_the_user_is_a_named_error(tmp_path):
  data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}, {"messages": CONVERSATIONS[1][:-1]}])
  with pytest.raises(chat.LastTurnNotAssistant, match=r"chat.jsonl:2: the conversation ends with a 'user' turn"):
    build_data(DataConfig(source=str(data), tokenizer=str(QWEN3), val_fraction=0.0), 1, process_index=0,
               process_count=1)


def test_prompt_completion_records_train_on_the_completion_only(tmp_path):
  """Plain strings: no template, the loss on the completion and its EOS. Conversational: the prompt's assistant turn
  is context, only the completion's reply is trained."""
  plain = _jsonl(tmp_path / "plain.jsonl", [{"prompt": "Repeat: the model", "completion": " the model"}] * 2)
  bundle = build_data(DataConfig(source=str(plain), tokenizer=str(QWEN3), val_fraction=0.0, seq_len=32), 2,
                      process_index=0, process_count=1)
  tok = bundle.tokenizer
  p, c = tok.encode("Repeat: the model"), tok.encode(" the model")
  row = bundle.train.rows([0])
  assert row["mask"][0].sum() == len(c) + 1 and row["prompt_len"][0] == len(p)
  assert row["targets"][0, len(p) + len(c) - 1] == tok.eos_id

  convo = CONVERSATIONS[1]
  pair = {"prompt": convo[:-1], "completion": convo[-1:]}
  conv = _jsonl(tmp_path / "conv.jsonl", [pair, pair])
  assert resolve_format("auto", str(conv), "text") == "prompt_completion"
  rows = build_data(DataConfig(source=str(conv), tokenizer=str(QWEN3), val_fraction=0.0, seq_len=128), 2,
                    process_index=0, process_count=1).train
  full = chat.render(chat.load_chat_tokenizer(str(QWEN3)), convo)
  last = np.zeros_like(full.mask)
  last[full.prompt_len:] = full.mask[full.prompt_len:]
  n = len(full.ids)
  np.testing.assert_array_equal(rows.rows([0])["mask"][0, :n - 1], last[1:])
  assert 0 < last.sum() < full.mask.sum()


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_dataset_records_through_an_hf_source(tmp_path, kind):
  """A parquet file and a `datasets` directory (auto-detected as messages) give the rows of their conversations."""
  datasets = pytest.importorskip("datasets")

  table = datasets.Dataset.from_list([{"messages": m} for m in CONVERSATIONS])
  path = tmp_path / ("chat.parquet" if kind == "parquet" else "chat_ds")
  table.to_parquet(str(path)) if kind == "parquet" else table.save_to_disk(str(path))
  cfg = DataConfig(source=f"hf:{path}", tokenizer=str(QWEN3), val_fraction=0.0, seq_len=128)
  bundle = build_data(cfg, 1, process_index=0, process_count=1)
  assert bundle.stats["format"] == "messages"
  tok = chat.load_chat_tokenizer(str(QWEN3))
  for i, m in enumerate(CONVERSATIONS):
    want = chat.render(tok, m)
    n = len(want.ids)
    np.testing.assert_array_equal(bundle.train.tokens[i, :n], want.ids)
    np.testing.assert_array_equal(bundle.train.loss[i, :n], want.mask)


def test_data_format_is_checked_and_detected():
  with pytest.raises(ValueError, match=r"data.format='chat'; choose one of"):
    DataConfig(format="chat")
  assert resolve_format("auto", str(CHAT_FILE), "text") == "messages"
  assert resolve_format("auto", str(ROOT / "tests" / "fixtures" / "hf_text.jsonl"), "text") == "text"
  assert resolve_format("auto", "stdlib", "text") == "text"


def test_the_shipped_chat_config_builds_its_data():
  from meshdistill.config import load_config

  cfg = load_config(str(ROOT / "configs" / "chat.yaml"))  # teacher.hf: data.tokenizer is the teacher's directory
  bundle = build_data(cfg.data, cfg.train.batch_size, process_index=0, process_count=1)
  assert bundle.stats["format"] == "messages" and bundle.stats["train_targets"] > 0
  assert bundle.tokenizer.eos_id == chat.load_chat_tokenizer(str(QWEN3)).convert_tokens_to_ids("<|im_end|>")
