//! vLLM's `return_token_ids`: the prompt's and the answer's token ids beside the text, so a
//! caller (an RL trainer scoring its own samples, a debugger) need not re-tokenize and hope
//! for the same split. Streamed, each chunk carries the ids of the tokens it completes
//! (`token_ids`, possibly none while text is held back) and the first chunk the prompt's.

use serde_json::{json, Value};

pub struct StreamTokenIds {
    /// Per prompt, its ids; choice i belongs to prompt i / n.
    prompts: Vec<Vec<u32>>,
    n: usize,
    /// Chat has one prompt and puts its ids on the response; completions on each choice.
    prompt_on_response: bool,
    /// Whether generated tokens are part of the answer (not for an echo with `max_tokens: 0`).
    answer_tokens: bool,
    /// Per choice, generated ids no chunk has carried yet.
    pending: Vec<Vec<u32>>,
    /// Per choice (or, for chat, the response at 0), whether the prompt's ids went out.
    prompt_sent: Vec<bool>,
}

impl StreamTokenIds {
    pub fn new(prompts: Vec<Vec<u32>>, n: usize, prompt_on_response: bool, answer_tokens: bool) -> Self {
        let choices = prompts.len() * n;
        Self {
            prompts,
            n,
            prompt_on_response,
            answer_tokens,
            pending: vec![Vec::new(); choices],
            prompt_sent: vec![false; choices.max(1)],
        }
    }

    pub fn token(&mut self, choice: usize, token: u32) {
        if let (true, Some(p)) = (self.answer_tokens, self.pending.get_mut(choice)) {
            p.push(token);
        }
    }

    /// Adds the ids to a chunk about to go out (a usage-only chunk has no choices and gets none).
    pub fn annotate(&mut self, chunk: &mut Value) {
        let Some(choices) = chunk.get_mut("choices").and_then(Value::as_array_mut).filter(|c| !c.is_empty()) else {
            return;
        };
        for c in choices.iter_mut() {
            let Some(i) =
                c.get("index").and_then(Value::as_u64).map(|i| i as usize).filter(|&i| i < self.pending.len())
            else {
                continue;
            };
            c["token_ids"] = json!(std::mem::take(&mut self.pending[i]));
            if !self.prompt_on_response && !self.prompt_sent[i] {
                self.prompt_sent[i] = true;
                c["prompt_token_ids"] = json!(self.prompts[i / self.n]);
            }
        }
        if self.prompt_on_response && !self.prompt_sent[0] {
            self.prompt_sent[0] = true;
            chunk["prompt_token_ids"] = json!(self.prompts.first().cloned().unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_chunk_carries_the_tokens_it_completes_and_the_first_the_prompt() {
        let mut ids = StreamTokenIds::new(vec![vec![1, 2], vec![3]], 2, false, true);
        ids.token(1, 10);
        ids.token(1, 11); // held back: the next chunk of choice 1 carries both
        ids.token(2, 20);
        let mut a = json!({"choices": [{"index": 1, "text": "ab"}]});
        ids.annotate(&mut a);
        assert_eq!(a["choices"][0]["token_ids"], json!([10, 11]));
        assert_eq!(a["choices"][0]["prompt_token_ids"], json!([1, 2]));
        let mut b = json!({"choices": [{"index": 1, "text": ""}]});
        ids.annotate(&mut b);
        assert_eq!(b["choices"][0]["token_ids"], json!([]));
        assert!(b["choices"][0].get("prompt_token_ids").is_none());
        let mut c = json!({"choices": [{"index": 2, "text": "c"}]});
        ids.annotate(&mut c);
        assert_eq!((&c["choices"][0]["token_ids"], &c["choices"][0]["prompt_token_ids"]), (&json!([20]), &json!([3])));
        let mut usage = json!({"choices": [], "usage": {}});
        ids.annotate(&mut usage);
        assert_eq!(usage, json!({"choices": [], "usage": {}}));

        // Chat: the prompt once, on the response; an echo-only answer has no tokens.
        let mut chat = StreamTokenIds::new(vec![vec![5, 6]], 1, true, false);
        chat.token(0, 7);
        let mut first = json!({"choices": [{"index": 0, "delta": {}}]});
        chat.annotate(&mut first);
        assert_eq!((&first["prompt_token_ids"], &first["choices"][0]["token_ids"]), (&json!([5, 6]), &json!([])));
        let mut second = json!({"choices": [{"index": 0, "delta": {}}]});
        chat.annotate(&mut second);
        assert!(second.get("prompt_token_ids").is_none());
    }
}
