//! Our GGUF byte-level BPE tokenizer against llama.cpp's own tokenizer test vectors
//! (`models/ggml-vocab-*.gguf` with `.inp` / `.out`, fetched by tests/reference/fetch-vocab-tests).
//! `.inp` holds the cases separated by `\n__ggml_vocab_test__\n`; `.out` has one line of
//! space-separated token ids per case (tokenized without BOS and without special-token parsing).

mod common;

use std::path::PathBuf;

use wasmserve::model::format::gguf::GgufFile;
use wasmserve::model::tokenizer::Tokenizer;

fn vocab_dir() -> PathBuf {
    let d = common::repo_root().join("tests/data/llama-vocab");
    assert!(
        d.join("ggml-vocab-gpt-2.gguf").exists(),
        "{} is missing: run tests/reference/fetch-vocab-tests",
        d.display()
    );
    d
}

/// Returns (cases checked, failures as "case: got vs want").
fn check(name: &str) -> (usize, Vec<String>) {
    let dir = vocab_dir();
    let g = GgufFile::open(&dir.join(format!("ggml-vocab-{name}.gguf"))).unwrap();
    let tok = Tokenizer::from_gguf(&g).unwrap();
    let inp = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.inp"))).unwrap();
    let out = std::fs::read_to_string(dir.join(format!("ggml-vocab-{name}.gguf.out"))).unwrap();
    let mut cases: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    if cases.last() == Some(&"") {
        cases.pop();
    }
    let want: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(cases.len(), want.len(), "{name}: {} cases but {} expected lines", cases.len(), want.len());
    let mut failures = Vec::new();
    for (case, want) in cases.iter().zip(&want) {
        let got = tok.encode(case, false).unwrap();
        if &got != want {
            failures.push(format!("{case:?}: got {got:?}, want {want:?}"));
        }
    }
    (cases.len(), failures)
}

macro_rules! vocab_test {
    ($fn:ident, $name:literal) => {
        #[test]
        fn $fn() {
            let (n, failures) = check($name);
            assert!(n > 20, "too few cases");
            assert!(failures.is_empty(), "{}: {} of {n} cases differ:\n{}", $name, failures.len(), failures.join("\n"));
        }
    };
}

vocab_test!(gpt2, "gpt-2");
vocab_test!(starcoder_digit_splitting, "starcoder");
vocab_test!(refact, "refact");
vocab_test!(mpt, "mpt");
vocab_test!(llama3_bpe, "llama-bpe");
vocab_test!(qwen2, "qwen2");
