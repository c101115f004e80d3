//! Stop strings over a text stream. Text that might be the start of a stop string is held back
//! until it is known not to be, so a client never sees part of a stop string.

pub struct StopChecker {
    stops: Vec<String>,
    pending: String,
    max_len: usize,
}

pub enum StopOutcome {
    /// Text that is safe to emit now.
    Continue(String),
    /// A stop string was hit: emit this text (before the stop string) and finish.
    Stopped(String),
}

impl StopChecker {
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        Self { stops, pending: String::new(), max_len }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(delta.to_string());
        }
        self.pending.push_str(delta);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for l in (1..s.len().min(self.pending.len() + 1)).rev() {
                // Both boundary checks before any slicing: a stop string's prefix may end inside
                // one of its characters ("é" has a 1-byte proper prefix).
                if s.is_char_boundary(l) && self.pending.is_char_boundary(self.pending.len() - l) && self.pending.ends_with(&s[..l]) {
                    keep = keep.max(l);
                    break;
                }
            }
        }
        debug_assert!(keep < self.max_len.max(1));
        let emit_to = self.pending.len() - keep;
        let out = self.pending[..emit_to].to_string();
        self.pending.drain(..emit_to);
        StopOutcome::Continue(out)
    }

    /// Whatever is still held back (at the end of generation for another reason).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut c = StopChecker::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            match c.push(d) {
                StopOutcome::Continue(t) => out.push_str(&t),
                StopOutcome::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&c.flush());
        (out, false)
    }

    /// Multi-byte stop strings: their byte prefixes that end inside a character are skipped, not
    /// sliced (which panicked), and a character split over deltas is still held back.
    #[test]
    fn non_ascii_stop_strings() {
        assert_eq!(run(&["é"], &["a", "b", "c"]), ("abc".into(), false));
        assert_eq!(run(&["é"], &["ab", "é", "c"]), ("ab".into(), true));
        assert_eq!(run(&["aé"], &["xa", "é"]), ("x".into(), true));
        assert_eq!(run(&["aé"], &["xa", "b"]), ("xab".into(), false));
        assert_eq!(run(&["。", "→x"], &["one", "→", "x two"]), ("one".into(), true));
        assert_eq!(run(&["日本"], &["今日", "本"]), ("今".into(), true));
    }

    #[test]
    fn stop_split_across_deltas_is_never_emitted() {
        assert_eq!(run(&["END"], &["abc E", "N", "D more"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "x"]), ("abc Ex".into(), false));
        assert_eq!(run(&["\n\n", "."], &["Paris", ". Next"]), ("Paris".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }
}
