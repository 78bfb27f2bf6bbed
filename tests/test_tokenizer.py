"""A GGUF's tokenizer is converted once and reloaded from the cache folder: the reloaded one encodes, applies the
chat template and names special tokens exactly as the converted one; a damaged entry is converted again."""
import os

from lanner.models.loader import ModelSource, _tokenizer_cache_dir, load_tokenizer

TEXTS = ["Hello <|im_start|> world", "def f(x):\n\treturn x**2  # émoji 🎉", "  spaces   and\n\nnewlines"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|>"}]


def test_gguf_tokenizer_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LANNER_CACHE", str(tmp_path))
    src = ModelSource.resolve(None)
    entry = _tokenizer_cache_dir(src.path)
    assert entry.startswith(str(tmp_path)) and not os.path.exists(entry)
    converted = load_tokenizer(src)
    assert os.path.exists(os.path.join(entry, "tokenizer_config.json"))
    cached = load_tokenizer(src)
    for t in TEXTS:
        assert cached.encode(t) == converted.encode(t)
        assert cached.encode(t, add_special_tokens=False, split_special_tokens=True) == \
            converted.encode(t, add_special_tokens=False, split_special_tokens=True)
    assert cached.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        converted.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert (cached.eos_token_id, cached.all_special_ids, len(cached)) == \
        (converted.eos_token_id, converted.all_special_ids, len(converted))
    with open(os.path.join(entry, "tokenizer.json"), "w") as f:
        f.write("{broken")
    assert load_tokenizer(src).encode(TEXTS[1]) == converted.encode(TEXTS[1])  # converted again...
    assert load_tokenizer(src).encode(TEXTS[1]) == converted.encode(TEXTS[1])  # ...and the entry replaced
    with open(os.path.join(entry, "tokenizer.json")) as f:
        assert f.read(1) == "{" and os.listdir(tmp_path / "tokenizers") == [os.path.basename(entry)]
    monkeypatch.setenv("LANNER_CACHE", "")
    assert _tokenizer_cache_dir(src.path) is None


def test_chat_template_is_thread_safe():
    """The server tokenizes requests on worker threads. transformers' split_special_tokens flips a flag on the
    shared Rust tokenizer, so untrusted text encoded on one thread made another thread's template split its own
    <|im_start|> into plain text (the soak's "greedy answer differs" bug). Every thread must get the ids a lone
    call gets: template specials parsed, user text's specials kept as text."""
    from concurrent.futures import ThreadPoolExecutor

    from lanner.tokenizer import Tokenizer

    tok = Tokenizer(ModelSource.resolve(None))
    messages = [[{"role": "user", "content": f"Tell me one fact about topic {i} <|im_end|> " * (1 + i % 3)}]
                for i in range(8)]
    for t in TEXTS:
        assert tok.encode_text(t) == tok.hf.encode(t, add_special_tokens=False, split_special_tokens=True)
    expected = [tok.apply_chat_template(m) for m in messages]
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert all(ids.count(im_start) == 3 for ids in expected)  # system, user, assistant; none from the user text
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: tok.apply_chat_template(messages[i % 8]), range(400)))
    assert [g == expected[i % 8] for i, g in enumerate(got)] == [True] * 400
