//! Incremental detokenization for streaming.
//!
//! Decoding token by token breaks multi-byte characters that span tokens, and BPE decoders may
//! change earlier text when context arrives (spaces, byte fallback). So, like vLLM, we decode a
//! short window twice — with and without the newest tokens — and emit only the stable suffix,
//! holding back output that still ends in an incomplete UTF-8 sequence.

use super::Tokenizer;

/// Tokens of left context kept when decoding a window.
const CONTEXT_TOKENS: usize = 6;

#[derive(Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix_offset: usize,
    /// Tokens up to here have been turned into emitted text.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self { skip_special_tokens, ..Default::default() }
    }

    /// Starts after `context` (e.g. the prompt) so the first token decodes with its left context.
    pub fn with_context(context: &[u32], skip_special_tokens: bool) -> Self {
        let start = context.len().saturating_sub(CONTEXT_TOKENS);
        Self {
            ids: context[start..].to_vec(),
            prefix_offset: 0,
            read_offset: context.len() - start,
            skip_special_tokens,
        }
    }

    /// Adds one token; returns the text that became final (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens);
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            // Keep the window short: drop tokens that can no longer affect decoding.
            if self.prefix_offset > 4 * CONTEXT_TOKENS {
                let cut = self.prefix_offset - CONTEXT_TOKENS;
                self.ids.drain(..cut);
                self.prefix_offset -= cut;
                self.read_offset -= cut;
            }
            delta
        } else {
            String::new()
        }
    }

    /// Text held back so far (incomplete characters at the end of the stream), lossily decoded.
    pub fn flush(&mut self, tok: &Tokenizer) -> String {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens);
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens);
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }
}
