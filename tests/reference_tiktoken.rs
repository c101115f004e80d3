//! Kimi-style tiktoken tokenizers (`tiktoken.model` + `tokenizer_config.json`, no
//! tokenizer.json) against Python `tiktoken` built from the same ranks, Kimi's pattern and the
//! same special tokens (tests/reference/make_tiktoken_kimi.py): token for token on CJK, emoji,
//! code, whitespace runs, contractions and every special token spelled in text; decoding back;
//! the reserved-slot naming and which specials survive `skip_special_tokens`.

mod common;

use wasmserve::model::tokenizer::Tokenizer;

fn dir(which: &str) -> std::path::PathBuf {
    common::repo_root().join("tests/reference/tiktoken_kimi").join(which)
}

fn load(which: &str) -> Tokenizer {
    let d = dir(which);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    Tokenizer::from_hf_dir(&d, &cfg).unwrap_or_else(|e| panic!("{which}: {e}"))
}

#[test]
fn encodes_and_decodes_like_python_tiktoken() {
    let tok = load("large");
    let cases: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir("large").join("cases.json")).unwrap()).unwrap();
    let ids = |v: &serde_json::Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
    };
    let mut specials_seen = 0;
    for c in cases["cases"].as_array().unwrap() {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = tok.encode(text, false).unwrap();
        assert_eq!(got, want, "ids of {text:?}");
        assert_eq!(tok.decode(&got, false), c["decoded"].as_str().unwrap(), "decoded {text:?}");
        specials_seen += got.iter().filter(|&&id| id >= 2692).count();
    }
    assert!(specials_seen >= 20, "the cases spell every special token");
}

#[test]
fn special_slots_are_named_and_skipped_as_kimi_marks_them() {
    let tok = load("large");
    // 2,692 ranks, then K3's named specials, then placeholders up to config.json's vocab_size.
    assert_eq!(tok.vocab_size(), 2692 + 64);
    assert_eq!(tok.token_to_id("[BOS]"), Some(2692));
    assert_eq!(tok.token_to_id("<|end_of_msg|>"), Some(2694));
    assert_eq!(tok.id_to_token(2755).as_deref(), Some("<|reserved_token_2755|>"));
    assert_eq!(tok.bos_token_id, Some(2692));
    assert!(tok.eos_token_ids.contains(&2693), "{:?}", tok.eos_token_ids);
    let think = tok.token_to_id("<think>").unwrap();
    let open = tok.token_to_id("<|open|>").unwrap();
    let text = tok.encode("hello", false).unwrap();
    let ids: Vec<u32> = [open].into_iter().chain([think]).chain(text.iter().copied()).collect();
    // `<think>` is marked "special": false (kept), `<|open|>` special (skipped).
    assert_eq!(tok.decode(&ids, true), "<think>hello");
    assert_eq!(tok.decode(&ids, false), "<|open|><think>hello");
    // Out-of-range ids decode to nothing rather than panicking.
    assert_eq!(tok.decode(&[999_999], false), "");
}
