"""Makes tiny random Hugging Face checkpoints and their transformers logits for tests/test_hf.py.

Run by hand (needs torch and transformers, which the test suite itself does not):

    pip install torch==2.13.0
    python scripts/make_hf_fixtures.py                  # writes tests/fixtures/hf_*
    python scripts/make_hf_fixtures.py --check-export   # meshdistill export -> transformers logits
    python scripts/make_hf_fixtures.py --tokenizer      # only the text and tokenizer (needs `tokenizers` only)
    python scripts/make_hf_fixtures.py hf_gemma3        # only the fixtures named (also with --check-export)
    python scripts/make_hf_fixtures.py --pruned         # each dense fixture pruned, exported, run by transformers

Each fixture directory holds config.json, bfloat16 safetensors weights (the Llama one sharded,
with model.safetensors.index.json) and ``reference.npz`` = {tokens [2, 12] int32, logits
[2, 12, V] float32} computed by transformers in float32 from exactly the stored weights (mixture-of-experts
fixtures also ``aux_mask`` [2, 12] and ``aux_loss``: transformers' load-balancing loss with that attention mask).
Norm scales and biases are randomised too, so a mis-mapped norm or bias changes the logits.
``--pruned`` writes, for each dense fixture NAME, ``tests/fixtures/pruned/NAME.json`` (the units a pruned student
keeps) and ``NAME.npz`` (transformers' logits of that student as meshdistill exports it; tests/test_compress.py),
outside the checkpoint directories, which hold only what a Hugging Face checkpoint holds.

``--tokenizer`` writes ``tests/fixtures/hf_text.jsonl`` (a small JSONL corpus, ``text`` field),
``examples/data/chat.jsonl`` (short conversations, ``messages`` field) and a ``tokenizer.json`` for the Qwen3
fixture: a BPE of at most 128 tokens (the fixture's vocabulary) trained on that text and the conversations'
turns, with ``<|endoftext|>`` as its end-of-text token and the ChatML turn markers ``<|im_start|>`` /
``<|im_end|>`` as special tokens, so the CLI can distil the fixture on real text (configs/hf_example.yaml).
Beside it ``tokenizer_config.json`` and ``chat_template.jinja``: a ChatML template in Qwen's form (no
``{% generation %}`` markers, as Qwen's own), for chat distillation (configs/chat.yaml, tests/test_chat.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
TOKENS = np.random.default_rng(0).integers(0, 128, (2, 12)).astype(np.int32)

TOKENIZER_FIXTURE = "hf_qwen3"
TEXT_FILE = FIXTURES / "hf_text.jsonl"
CHAT_FILE = ROOT / "examples" / "data" / "chat.jsonl"
CHAT_SPECIAL = ["<|im_start|>", "<|im_end|>"]  # ChatML's turn markers, Qwen's end of turn
# ChatML as Qwen writes it (without Qwen3's reasoning-block handling): every turn
# "<|im_start|>ROLE\nCONTENT<|im_end|>\n", the generation prompt "<|im_start|>assistant\n".
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
WORDS = (
    "the teacher model writes a distribution over the next token and the student learns to match it "
    "a small model trained on soft targets sees how likely every other token was not only the right one "
    "layers of the student start as copies of chosen teacher blocks so its first steps are already close "
    "weights are split over the tensor axis and the batch over the data axis of one mesh "
    "checkpoints are saved every few steps and a run resumes where it stopped"
).split()


def make_conversations(rng) -> list[dict]:
  """Short conversations over `WORDS` (``{"messages": [{role, content}, ...]}``), one to three exchanges, some with a
  system turn: the assistant repeats, reverses or counts the words it is given."""
  tasks = (
      ("Repeat", lambda w: " ".join(w)),
      ("Reverse", lambda w: " ".join(reversed(w))),
      ("Count", lambda w: f"{len(w)} words"),
  )
  out = []
  for _ in range(96):
    turns = [{"role": "system", "content": "Answer briefly."}] if rng.random() < 0.3 else []
    for _ in range(int(rng.choice([1, 1, 2, 3]))):
      name, answer = tasks[int(rng.integers(len(tasks)))]
      words = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(2, 5)))]
      turns += [{"role": "user", "content": f"{name}: {' '.join(words)}"},
                {"role": "assistant", "content": answer(words)}]
    out.append({"messages": turns})
  return out


def make_text_and_tokenizer() -> None:
  """Writes the JSONL corpus, the conversations and the Qwen3 fixture's tokenizer files (deterministic)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

  rng = np.random.default_rng(0)
  docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(20, 60)))).capitalize() + "." for _ in range(120)]
  TEXT_FILE.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  chats = make_conversations(rng)
  CHAT_FILE.parent.mkdir(parents=True, exist_ok=True)
  CHAT_FILE.write_text("".join(json.dumps(c) + "\n" for c in chats))
  turns = [f"{m['role']}\n{m['content']}\n" for c in chats for m in c["messages"]]  # the template's text, no markers
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  tok.decoder = decoders.Metaspace()
  trainer = trainers.BpeTrainer(vocab_size=128, special_tokens=["<|endoftext|>", "<unk>", *CHAT_SPECIAL],
                                show_progress=False)
  tok.train_from_iterator(docs + turns, trainer)
  out = FIXTURES / TOKENIZER_FIXTURE / "tokenizer.json"
  tok.save(str(out))
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "unk_token": "<unk>", "bos_token": None, "model_max_length": 64, "clean_up_tokenization_spaces": False}
  (out.parent / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  (out.parent / "chat_template.jinja").write_text(CHAT_TEMPLATE)
  for other in ("hf_gemma3",):  # the Gemma 3 fixture's CLI run (configs/gemma3_example.yaml) reads the same text
    if (FIXTURES / other).is_dir():
      tok.save(str(FIXTURES / other / "tokenizer.json"))
  print(f"{TEXT_FILE.name}: {len(docs)} documents, {TEXT_FILE.stat().st_size / 1024:.0f} KiB; "
        f"{CHAT_FILE.name}: {len(chats)} conversations; "
        f"{out.relative_to(FIXTURES)}: {tok.get_vocab_size()} tokens, {out.stat().st_size / 1024:.0f} KiB")


COMMON = dict(vocab_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
              max_position_embeddings=64, hidden_act="silu")

GEMMA = dict({k: v for k, v in COMMON.items() if k != "hidden_act"}, vocab_size=130,
             hidden_activation="gelu_pytorch_tanh")


def _models() -> dict:
  import transformers

  return {
      # Llama 3.x: untied head, rope_theta 500000 and Llama-3 frequency scaling whose bands all
      # fall inside head_dim=16 (original_max_position_embeddings=16); sharded safetensors.
      "hf_llama": (
          transformers.LlamaConfig,
          dict(COMMON, hidden_size=64, intermediate_size=96, tie_word_embeddings=False, rope_theta=500_000.0,
               rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=16)),
          transformers.LlamaForCausalLM,
          "40KB",
      ),
      # Qwen3: q/k RMSNorm, explicit head_dim (4 x 16 = 64 != hidden 48), tied embeddings.
      "hf_qwen3": (
          transformers.Qwen3Config,
          dict(COMMON, hidden_size=48, head_dim=16, intermediate_size=96, tie_word_embeddings=True,
               rope_theta=1_000_000.0),
          transformers.Qwen3ForCausalLM,
          None,
      ),
      # Qwen2: q/k/v biases.
      "hf_qwen2": (
          transformers.Qwen2Config,
          dict(COMMON, hidden_size=32, intermediate_size=64, num_hidden_layers=1, tie_word_embeddings=False,
               rope_theta=1_000_000.0),
          transformers.Qwen2ForCausalLM,
          None,
      ),
      # Mistral: a sliding window (4) shorter than the sequence (12), untied head.
      "hf_mistral": (
          transformers.MistralConfig,
          dict(COMMON, hidden_size=64, head_dim=16, intermediate_size=96, tie_word_embeddings=False,
               sliding_window=4, rope_theta=1_000_000.0),
          transformers.MistralForCausalLM,
          None,
      ),
      # Gemma 3 text: sliding (window 4) and global layers with their own RoPE (global: linear scaling x2),
      # query_pre_attn_scalar != head_dim, q/k norms, tied embeddings, a vocabulary (130) 4 does not divide.
      "hf_gemma3": (
          transformers.Gemma3TextConfig,
          dict(GEMMA, hidden_size=64, head_dim=16, intermediate_size=96, num_hidden_layers=4, sliding_window=4,
               query_pre_attn_scalar=24,
               layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
          transformers.Gemma3ForCausalLM,
          None,
      ),
      # Gemma 2: soft-capped attention scores (cap 2) and logits (cap 3), small enough to matter; alternating
      # sliding (window 4) and global layers; a vocabulary (130) 4 does not divide.
      "hf_gemma2": (
          transformers.Gemma2Config,
          dict(GEMMA, hidden_size=32, head_dim=8, intermediate_size=64, num_hidden_layers=2, sliding_window=4,
               query_pre_attn_scalar=16,
               attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=10_000.0),
          transformers.Gemma2ForCausalLM,
          None,
      ),
      # Qwen3-MoE: 8 experts, top-2, no renormalisation of the top-2 weights; layer 1 keeps a dense MLP of another
      # width (mlp_only_layers), so both block kinds and both hidden sizes are read.
      "hf_qwen3_moe": (
          transformers.Qwen3MoeConfig,
          dict(COMMON, num_hidden_layers=3, hidden_size=32, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
               num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
               tie_word_embeddings=False, rope_theta=1_000_000.0),
          transformers.Qwen3MoeForCausalLM,
          None,
      ),
      # Mixtral: 4 experts, top-2 (weights renormalised), experts in every layer.
      "hf_mixtral": (
          transformers.MixtralConfig,
          dict(COMMON, hidden_size=32, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
               tie_word_embeddings=False, rope_theta=1_000_000.0),
          transformers.MixtralForCausalLM,
          None,
      ),
  }


def _randomise(model, seed: int) -> None:
  import torch

  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn(p.shape, generator=g))
      else:
        p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
      p.copy_(p.to(torch.bfloat16).to(torch.float32))  # exactly what the bfloat16 files hold


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
  import torch

  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def make(name: str, seed: int) -> None:
  import torch

  config_cls, kw, model_cls, shard_size = _models()[name]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**kw)).float().eval()
  _randomise(model, seed)
  logits = logits_of(model, TOKENS)
  extra = {}
  if hasattr(model.config, "router_aux_loss_coef"):  # mixture of experts: transformers' load-balancing loss, padded
    aux_mask = np.ones(TOKENS.shape, np.int32)
    aux_mask[1, 8:] = 0
    with torch.no_grad():
      out = model(torch.from_numpy(TOKENS).long(), attention_mask=torch.from_numpy(aux_mask).long(),
                  output_router_logits=True)
    extra = {"aux_mask": aux_mask, "aux_loss": np.float32(out.aux_loss)}
  out = FIXTURES / name
  out.mkdir(parents=True, exist_ok=True)
  for old in out.glob("*.safetensors*"):
    old.unlink()
  model.to(torch.bfloat16).save_pretrained(out, max_shard_size=shard_size or "1GB", safe_serialization=True)
  np.savez_compressed(out / "reference.npz", tokens=TOKENS, logits=logits, **extra)
  size = sum(p.stat().st_size for p in out.iterdir())
  print(f"{name}: {sorted(p.name for p in out.iterdir())}, {size / 1024:.0f} KiB")


def check_export(names=()) -> int:
  """Loads each fixture with meshdistill, exports it, loads the export with transformers, compares logits."""
  import torch
  import transformers

  sys.path.insert(0, str(ROOT / "src"))
  from meshdistill.models.hf import export_hf, load_hf

  worst = 0.0
  for name in names or _models():
    ref = np.load(FIXTURES / name / "reference.npz")
    with tempfile.TemporaryDirectory() as tmp:
      export_hf(load_hf(FIXTURES / name), tmp, tokenizer=None)
      reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
      err = float(np.abs(logits_of(reloaded, ref["tokens"]) - ref["logits"]).max())
    print(f"{name}: transformers logits of the meshdistill export, max |diff| = {err:.2e}")
    worst = max(worst, err)
  return 0 if worst < 1e-4 else 1


PRUNABLE = ("hf_llama", "hf_qwen3", "hf_qwen2", "hf_mistral", "hf_gemma2", "hf_gemma3")


def make_pruned(names=()) -> int:
  """Cuts each dense fixture to a random half of its MLP units and query groups, three quarters of its embedding
  channels and all but one block (``pruned/NAME.json``), exports the pruned student with meshdistill and writes
  transformers' logits of that export (``pruned/NAME.npz``) for tests/test_compress.py."""
  import torch
  import transformers

  sys.path.insert(0, str(ROOT / "src"))
  from meshdistill.models.compress import Kept, prune_weights
  from meshdistill.models.hf import export_hf, load_hf

  for i, name in enumerate(names or PRUNABLE):
    path = FIXTURES / name
    teacher = load_hf(path)
    cfg = teacher.cfg
    rng = np.random.default_rng(100 + i)
    pick = lambda n, k: tuple(sorted(int(v) for v in rng.choice(n, k, replace=False)))  # noqa: E731
    layers = pick(cfg.n_layers, max(1, cfg.n_layers - 1))
    kept = Kept(layers=layers, mlp=tuple(pick(cfg.mlp_hidden, cfg.mlp_hidden // 2) for _ in layers),
                groups=tuple(pick(cfg.n_kv_heads, cfg.n_kv_heads // 2) for _ in layers),
                embed=pick(cfg.d_model, cfg.d_model * 3 // 4))
    family = json.loads((path / "config.json").read_text())["model_type"].removesuffix("_text")
    with tempfile.TemporaryDirectory() as tmp:
      export_hf(prune_weights(teacher, kept), tmp, family=family)
      model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
      logits = logits_of(model, TOKENS)
    (FIXTURES / "pruned").mkdir(exist_ok=True)
    (FIXTURES / "pruned" / f"{name}.json").write_text(json.dumps(kept.to_dict()) + "\n")
    np.savez(FIXTURES / "pruned" / f"{name}.npz", tokens=TOKENS, logits=logits)
    print(f"{name}: pruned to {len(kept.layers)} blocks, d_model {len(kept.embed)}, "
          f"{len(kept.groups[0])} query groups, mlp {len(kept.mlp[0])}; transformers logits written")
  return 0


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check-export", action="store_true", help="verify meshdistill exports with transformers")
  parser.add_argument("--pruned", action="store_true", help="write the pruned students' transformers logits")
  parser.add_argument("--tokenizer", action="store_true", help="write only the text corpus and the Qwen3 tokenizer")
  parser.add_argument("names", nargs="*", help="only these fixtures (e.g. hf_gemma3); default all")
  args = parser.parse_args()
  if args.check_export:
    return check_export(args.names)
  if args.pruned:
    return make_pruned(args.names)
  if args.tokenizer:
    make_text_and_tokenizer()
    return 0
  for i, name in enumerate(_models()):
    if not args.names or name in args.names:
      make(name, seed=i)
  if args.names:
    return 0
  make_text_and_tokenizer()
  return 0


if __name__ == "__main__":
  sys.exit(main())
