//! Constrained decoding to one of a fixed list of strings (vLLM's `structured_outputs:
//! {"choice": [...]}`, formerly `guided_choice`): every sampled token must keep the output a
//! prefix of some choice, and once it equals one, only EOS follows. Classification prompts use
//! it; the end-to-end parser tests use it to make the real model write a known text.

#[derive(Clone, Debug)]
pub struct ChoiceConstraint {
    choices: Vec<Vec<u8>>,
    /// Choices the output so far is a prefix of. `accepts` runs for every vocabulary token each
    /// step, so it must only compare the candidate's bytes, never the whole output again.
    live: Vec<usize>,
    sofar: Vec<u8>,
}

impl ChoiceConstraint {
    pub fn new(choices: &[String]) -> Self {
        Self {
            choices: choices.iter().map(|c| c.as_bytes().to_vec()).collect(),
            live: (0..choices.len()).collect(),
            sofar: Vec::new(),
        }
    }

    /// The output equals a choice (the first one reached ends it, as the shorter of two choices
    /// where one is a prefix of the other).
    pub fn is_complete(&self) -> bool {
        self.live.iter().any(|&i| self.choices[i].len() == self.sofar.len())
    }

    pub fn accepts(&self, bytes: &[u8]) -> bool {
        let (at, n) = (self.sofar.len(), self.sofar.len() + bytes.len());
        !bytes.is_empty() && self.live.iter().any(|&i| self.choices[i].get(at..n) == Some(bytes))
    }

    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        let ok = self.accepts(bytes);
        if ok {
            let (at, n) = (self.sofar.len(), self.sofar.len() + bytes.len());
            self.live.retain(|&i| self.choices[i].get(at..n) == Some(bytes));
            self.sofar.extend_from_slice(bytes);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::ChoiceConstraint;

    #[test]
    fn only_prefixes_of_a_choice_are_accepted() {
        let mut c = ChoiceConstraint::new(&["<think>ok</think>".into(), "no".into()]);
        assert!(c.accepts(b"<th") && c.accepts(b"n") && !c.accepts(b"x") && !c.accepts(b""));
        assert!(c.feed(b"<th") && !c.is_complete());
        assert!(!c.accepts(b"no"), "the other choice no longer fits");
        assert!(!c.feed(b"ink>ok</think>!"), "past the end of the choice");
        assert!(c.feed(b"ink>ok</think>") && c.is_complete());
        // Multi-byte characters may be split across tokens.
        let mut c = ChoiceConstraint::new(&["Zürich".into()]);
        assert!(c.feed(b"Z\xc3") && c.feed(b"\xbcrich") && c.is_complete());
    }
}
