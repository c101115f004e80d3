//! Incremental marker scanning: text arrives in deltas; markers (special tokens such as
//! `</think>`) may be split across deltas. The scanner yields plain text and whole markers,
//! holding back only a tail that could still become a marker.

pub enum Piece<'a> {
    Text(&'a str),
    Marker(usize),
}

#[derive(Default)]
pub struct Scanner {
    pending: String,
}

/// Length of the longest suffix of `s` that is a proper prefix of `m` (at a char boundary).
fn partial_len(s: &str, m: &str) -> usize {
    let max = s.len().min(m.len().saturating_sub(1));
    (1..=max)
        .rev()
        .find(|&k| s.is_char_boundary(s.len() - k) && m.as_bytes().starts_with(&s.as_bytes()[s.len() - k..]))
        .unwrap_or(0)
}

impl Scanner {
    /// Appends `delta`, then calls `f` with each resolved piece in order. `markers` may change
    /// between calls (the set depends on the caller's state), so `f` returns the set to use for
    /// the rest of the text.
    pub fn feed(
        &mut self,
        delta: &str,
        mut markers: &'static [&'static str],
        mut f: impl FnMut(Piece) -> &'static [&'static str],
    ) {
        self.pending.push_str(delta);
        let buf = std::mem::take(&mut self.pending);
        let mut rest = buf.as_str();
        loop {
            // Earliest marker; the longest one wins a tie.
            let hit = markers
                .iter()
                .enumerate()
                .filter_map(|(i, m)| rest.find(m).map(|p| (p, std::cmp::Reverse(m.len()), i)))
                .min();
            match hit {
                Some((p, _, i)) => {
                    if p > 0 {
                        // The text may change the caller's state (and so its marker set):
                        // rescan what is left with the set it returns.
                        markers = f(Piece::Text(&rest[..p]));
                        rest = &rest[p..];
                        continue;
                    }
                    let m = markers[i];
                    rest = &rest[m.len()..];
                    markers = f(Piece::Marker(i));
                }
                None => {
                    let hold = markers.iter().map(|m| partial_len(rest, m)).max().unwrap_or(0);
                    let (text, tail) = rest.split_at(rest.len() - hold);
                    if !text.is_empty() {
                        f(Piece::Text(text));
                    }
                    self.pending = tail.to_string();
                    return;
                }
            }
        }
    }

    /// The held-back tail, at the end of generation (it never became a marker).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// Runs `text` through the `Scanner` that `scanner` finds inside `stream`, handing each piece to
/// `piece` and asking `markers` for the marker set after every piece (the set depends on the
/// stream's state). The scanner is taken out of the stream for the call, so `piece` may borrow
/// the whole stream mutably.
pub fn scan_into<S>(
    stream: &mut S,
    scanner: fn(&mut S) -> &mut Scanner,
    text: &str,
    markers: fn(&S) -> &'static [&'static str],
    mut piece: impl FnMut(&mut S, Piece),
) {
    let mut scan = std::mem::take(scanner(stream));
    scan.feed(text, markers(stream), |p| {
        piece(stream, p);
        markers(stream)
    });
    *scanner(stream) = scan;
}

/// End of generation: the scanner's held-back tail (it never became a marker) goes to `piece`
/// as plain text.
pub fn flush_into<S>(stream: &mut S, scanner: fn(&mut S) -> &mut Scanner, mut piece: impl FnMut(&mut S, Piece)) {
    let tail = scanner(stream).flush();
    if !tail.is_empty() {
        piece(stream, Piece::Text(&tail));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(chunks: &[&str]) -> Vec<String> {
        let mut s = Scanner::default();
        let ms: &'static [&'static str] = &["<think>", "</think>"];
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, ms, |p| {
                out.push(match p {
                    Piece::Text(t) => t.to_string(),
                    Piece::Marker(i) => format!("[{i}]"),
                });
                ms
            });
        }
        out.push(s.flush());
        out
    }

    #[test]
    fn markers_split_across_deltas_are_found() {
        assert_eq!(run(&["a</th", "ink>b"]).concat(), "a[1]b");
        assert_eq!(run(&["<", "think", ">x<"]).concat(), "[0]x<");
        assert_eq!(run(&["é</thi"]).concat(), "é</thi");
    }
}
