//! Cost of one constrained-decoding mask over a real vocabulary: every token's bytes checked
//! against the constraint's state, which the engine does once a step's lazy draws are all refused
//! (`Sampler::sample_allowed`). The object recogniser (`json_object`) and the schema matcher
//! (`json_schema`, forced tool calls; also run on `{"type": "object"}` to compare like with like)
//! at a few positions of a JSON text.
//!
//! `cargo run --release -p wasmserve --example bench_constraints [-- model.gguf]`

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use wasmserve::model::format::gguf::GgufFile;
use wasmserve::model::tokenizer::Tokenizer;
use wasmserve::sampling::json_constraint::JsonState;
use wasmserve::sampling::json_schema::Schema;
use wasmserve::sampling::schema_constraint::SchemaState;

/// Median time of `reps` masks, and how many tokens the mask allows.
fn time_mask(vocab: &[Vec<u8>], accepts: impl Fn(&[u8]) -> bool, reps: usize) -> (Duration, usize) {
    let mut times = Vec::with_capacity(reps);
    let mut allowed = 0;
    for _ in 0..reps {
        let t = Instant::now();
        allowed = vocab.iter().filter(|b| accepts(b)).count();
        times.push(t.elapsed());
    }
    times.sort();
    (times[reps / 2], allowed)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let tokenizer = Tokenizer::from_gguf(&GgufFile::open(&path)?)?;
    let vocab: Vec<Vec<u8>> = tokenizer.token_bytes().into_iter().flatten().collect();
    println!("{} tokens from {}", vocab.len(), path.display());
    let cat = json!({"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "toys": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["ball", "mouse"]}, "price": {"type": "number"}}}}},
        "required": ["name", "age", "toys"]});
    let object = Arc::new(Schema::compile(&json!({"type": "object"}))?);
    let cat = Arc::new(Schema::compile(&cat)?);
    // Positions: before the object, a key's start, a value's start, inside a string, after a number.
    let prefixes = [
        "",
        r#"{"#,
        r#"{"name": "#,
        r#"{"name": "Tom, the"#,
        r#"{"name": "Tom", "age": 3"#,
        r#"{"name": "Tom", "age": 3, "toys": [{"kind": "ball", "price": "#,
    ];
    println!("{:<58} {:>14} {:>16} {:>14}", "after", "json_object µs", "object schema µs", "cat schema µs");
    for prefix in prefixes {
        let mut j = JsonState::default();
        let mut o = SchemaState::new(object.clone());
        let mut c = SchemaState::new(cat.clone());
        assert!(j.feed(prefix.as_bytes()) && o.feed(prefix.as_bytes()) && c.feed(prefix.as_bytes()), "{prefix}");
        let (tj, nj) = time_mask(&vocab, |b| j.accepts(b), 21);
        let (to, no) = time_mask(&vocab, |b| o.accepts(b), 21);
        let (tc, nc) = time_mask(&vocab, |b| c.accepts(b), 21);
        assert_eq!(nj, no, "the object recogniser and the object schema allow the same tokens");
        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!(
            "{:<58} {:>14.0} {:>16.0} {:>14.0}   ({nj} / {nc} allowed)",
            format!("{prefix:?}"),
            us(tj),
            us(to),
            us(tc)
        );
    }
    Ok(())
}
