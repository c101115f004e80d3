"""Kimi-style tiktoken tokenizers (`tiktoken.model` + `tokenizer_config.json`, no tokenizer.json)
and Python tiktoken's own token ids for tests/reference_tiktoken.rs.

No Kimi tokenizer can be downloaded here, so the ranks are a byte-level BPE trained on a mixed
corpus (English prose and code from the venv's Python sources, Chinese and Japanese sentences,
emoji) with `tokenizers`, exported the way tiktoken files are (base64 bytes, rank = merge order).
What is Kimi's is the rest:
  - the pre-tokenizer pattern, from Moonshot's `tokenization_kimi.py` as vLLM's Rust tokenizer
    carries it for `kimi_k3` models (QuantTrio/vllm-cubic `rust/src/tokenizer/src/tiktoken.rs`,
    `KIMI_PATTERN`, selected by `detect_bpe_pattern`);
  - the special tokens: every id from the end of the ranks up to config.json's `vocab_size` is a
    special token, named by `added_tokens_decoder` or `<|reserved_token_{id}|>` (as that loader and
    `tokenization_kimi.py` do), with K3's names (docs/formats.md §4.2; [3P]: K3's
    tokenizer_config.json itself is not reachable) and `special: false` for the think/tool
    markers, as Kimi's configs mark them.

Writes tests/reference/tiktoken_kimi/:
  large/  4,096 ranks + 64 special slots; cases.json: texts (CJK, emoji, code, whitespace runs,
          contractions, every special token spelled in text) with Python tiktoken's ids
          (`Encoding(pat_str, mergeable_ranks, special_tokens).encode(text, allowed_special="all")`
          and `encode_ordinary`), and decoded strings.
  tiny/   300 ranks + 20 special slots (ids up to 319): the tokenizer the tiny K3 checkpoints
          (make_tiny_kimi_k3.py, vocab 320) ship.

Run: .venv/bin/python tests/reference/make_tiktoken_kimi.py   (needs `pip install tiktoken==0.12.0`)
"""
import base64
import glob
import json
import os

import tiktoken
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tiktoken_kimi")

# Moonshot's pattern (tokenization_kimi.py), as vLLM's Rust tokenizer spells it for kimi_k3.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# K3's special tokens in their order after the ranks (names per docs/formats.md §4.1-4.2), and
# whether tokenizer_config.json marks them special (think/tool markers are not, as in Kimi K2's).
K3_SPECIALS = [
    ("[BOS]", True), ("[EOS]", True), ("<|end_of_msg|>", True), ("<|open|>", True), ("<|close|>", True),
    ("<|sep|>", True), ("<|im_system|>", True), ("<|im_middle|>", True), ("<|media_begin|>", True),
    ("<|media_content|>", True), ("<|media_end|>", True), ("<|media_pad|>", True), ("<think>", False),
    ("</think>", False), ("<|tool_calls_section_begin|>", False), ("<|tool_call_begin|>", False),
    ("[PAD]", True), ("[UNK]", True),
]

CJK = [
    "北京是中华人民共和国的首都，也是全国的政治和文化中心。",
    "今天天气很好，我们去公园散步吧！",
    "機械学習はデータからパターンを学ぶ技術です。カタカナとひらがなも混ざります。",
    "한국어 문장도 조금 넣어 봅니다.",
    "人工智能（AI）正在改变世界；深度学习模型需要大量数据。",
]
EMOJI = ["I love pizza 🍕🍕 and 🎉 parties!", "👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, ✅ done ❌ not", "Ünïcödé àçcénts — “quotes” ‘single’ …"]


def corpus():
    texts = CJK * 20 + EMOJI * 20
    for path in sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))[:60]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
    return texts


def train(vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    return tok


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def ranks_of(tok):
    """tiktoken ranks: the token's bytes → its id. HF's trainer numbers the 256-byte alphabet first
    and then each merge in order, which is exactly tiktoken's merge priority."""
    dec = byte_decoder()
    ranks = {}
    for piece, i in tok.get_vocab().items():
        ranks[bytes(dec[c] for c in piece)] = i
    assert sorted(ranks.values()) == list(range(len(ranks))), "ranks must be 0..n-1"
    return ranks


def write(d, ranks, slots):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tiktoken.model"), "w") as f:
        for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(b).decode()} {r}\n")
    base = len(ranks)
    named = K3_SPECIALS[:slots]
    added = {str(base + i): {"content": name, "lstrip": False, "normalized": False, "rstrip": False,
                             "single_word": False, "special": special} for i, (name, special) in enumerate(named)}
    cfg = {"added_tokens_decoder": added, "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]",
           "unk_token": "[UNK]", "model_max_length": 1048576, "tokenizer_class": "TikTokenTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}}
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    specials = {added[str(i)]["content"] if str(i) in added else f"<|reserved_token_{i}|>": i
                for i in range(base, base + slots)}
    return specials


def main():
    cases_text = CJK + EMOJI + [
        "def f(x):\n    return x ** 2  # square\n\n\n\tindented\ttabs   and   spaces    \n",
        "They're here; we'll see. I'd've thought IT'S fine. DON'T shout!",
        "Numbers: 1234567 3.14159 -42 1e10 0x7fff",
        "   leading and trailing spaces   ",
        "\n\n\nnewlines\r\n\r\nwindows\n",
        "CamelCaseWords and snake_case_words and ALLCAPS and MixedUP123abc",
        "naïve café résumé Ελληνικά Русский текст עברית العربية",
        "URL https://example.com/path?q=1&r=2#frag and email a.b@example.org",
        "",
        " ",
    ]
    for name, vocab, slots in [("large", 4096, 64), ("tiny", 300, 20)]:
        tok = train(vocab)
        ranks = ranks_of(tok)
        d = os.path.join(OUT, name)
        specials = write(d, ranks, slots)
        end = len(ranks) + slots
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"model_type": "kimi_k3", "text_config": {"model_type": "kimi_linear", "vocab_size": end}}, f, indent=1)
        if name != "large":
            assert end <= 320, f"the tiny K3 checkpoints have 320 ids, the tokenizer {end}"
            continue
        enc = tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
        special_text = "".join(n for n, _ in K3_SPECIALS) + f"<|reserved_token_{end - 1}|>"
        texts = cases_text + [
            f"hi{special_text}there",
            "<|open|>message role=\"user\"<|sep|>Hello<|close|>message<|sep|><|end_of_msg|>",
            "not special: <|open and |> apart, <|unknown|>, [BOS ] and <think >",
        ]
        cases = []
        for t in texts:
            ids = enc.encode(t, allowed_special="all")
            ordinary = enc.encode_ordinary(t)
            cases.append({"text": t, "ids": ids, "ordinary_ids": ordinary, "decoded": enc.decode(ids)})
        with open(os.path.join(d, "cases.json"), "w") as f:
            json.dump({"tiktoken": tiktoken.__version__, "pattern": KIMI_PATTERN, "cases": cases}, f, ensure_ascii=False, indent=1)
        print(name, len(ranks), "ranks, specials up to", end - 1, ",", len(cases), "cases; first CJK ids", cases[0]["ids"][:8])


if __name__ == "__main__":
    main()
