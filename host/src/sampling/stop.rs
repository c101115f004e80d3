//! Stop strings over a text stream. Text that might be the start of a stop string is held back
//! until it is known not to be, so a client never sees part of a stop string.

pub struct StopChecker {
    stops: Vec<String>,
    pending: String,
    max_len: usize,
    /// vLLM's `include_stop_str_in_output`: the text a stop string ends includes it.
    include_stop: bool,
}

pub enum StopOutcome {
    /// Text that is safe to emit now.
    Continue(String),
    /// A stop string was hit: emit this text (up to the stop string, or through it when asked
    /// to include it) and finish.
    Stopped(String),
}

impl StopChecker {
    pub fn new(stops: Vec<String>) -> Self {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_len = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        Self { stops, pending: String::new(), max_len, include_stop: false }
    }

    /// Ends the text a stop string stops with that stop string instead of just before it.
    pub fn including_stop(mut self) -> Self {
        self.include_stop = true;
        self
    }

    /// Text that may not stop generation (before `min_tokens` are generated, as vLLM: stop
    /// strings are only looked for once a sequence is past its minimum): emitted at once with
    /// whatever was held back.
    pub fn push_unchecked(&mut self, delta: &str) -> String {
        let mut out = std::mem::take(&mut self.pending);
        out.push_str(delta);
        out
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        if self.stops.is_empty() {
            return StopOutcome::Continue(delta.to_string());
        }
        self.pending.push_str(delta);
        // The earliest match; of stop strings matching there, the longest.
        if let Some((at, neg_len)) =
            self.stops.iter().filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, usize::MAX - s.len()))).min()
        {
            let end = if self.include_stop { at + (usize::MAX - neg_len) } else { at };
            let out = self.pending[..end].to_string();
            self.pending.clear();
            return StopOutcome::Stopped(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for l in (1..s.len().min(self.pending.len() + 1)).rev() {
                // Both boundary checks before any slicing: a stop string's prefix may end inside
                // one of its characters ("é" has a 1-byte proper prefix).
                if s.is_char_boundary(l)
                    && self.pending.is_char_boundary(self.pending.len() - l)
                    && self.pending.ends_with(&s[..l])
                {
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
        run_with(StopChecker::new(stops.iter().map(|s| s.to_string()).collect()), deltas)
    }

    fn run_with(mut c: StopChecker, deltas: &[&str]) -> (String, bool) {
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

    #[test]
    fn included_stop_strings_end_the_text() {
        let inc = |stops: &[&str]| StopChecker::new(stops.iter().map(|s| s.to_string()).collect()).including_stop();
        assert_eq!(run_with(inc(&["END"]), &["abc E", "N", "D more"]), ("abc END".into(), true));
        assert_eq!(run_with(inc(&["\n\n", "."]), &["Paris", ". Next"]), ("Paris.".into(), true));
        // Two stop strings matching at one place: the longer one is the stop.
        assert_eq!(run_with(inc(&["a", "ab"]), &["xab"]), ("xab".into(), true));
        assert_eq!(run_with(inc(&["é"]), &["ab", "é", "c"]), ("abé".into(), true));
    }

    #[test]
    fn unchecked_text_flushes_what_was_held_back_and_never_stops() {
        let mut c = StopChecker::new(vec!["END".into()]);
        assert!(matches!(c.push("ab E"), StopOutcome::Continue(t) if t == "ab "));
        assert_eq!(c.push_unchecked("ND x"), "END x");
        assert!(matches!(c.push(" y END z"), StopOutcome::Stopped(t) if t == " y "));
    }
}
