//! Stop strings over presentation text. Model history (token ids) is never touched:
//! the matcher only decides how much of the streamed text to show.

/// Result of feeding text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to show; generation continues.
    Continue(String),
    /// A stop string matched: show this text (everything before the stop) and end.
    Stopped { text: String, stop_index: usize },
}

/// Holds back only the shortest tail that could still begin a stop string.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
    done: bool,
}

impl StopMatcher {
    /// Empty stop strings are ignored.
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
            done: false,
        }
    }

    /// Feeds decoded text. After `Stopped`, further input yields empty `Continue`.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::Continue(String::new());
        }
        self.pending.push_str(text);
        let hit =
            self.stops.iter().enumerate().filter_map(|(i, s)| self.pending.find(s.as_str()).map(|p| (p, i))).min();
        if let Some((pos, stop_index)) = hit {
            self.done = true;
            let text = self.pending[..pos].to_string();
            self.pending.clear();
            return StopOutcome::Stopped { text, stop_index };
        }
        let hold = self.held_tail();
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopOutcome::Continue(out)
    }

    /// Releases held text at the end of generation.
    pub fn finish(&mut self) -> String {
        self.done = true;
        std::mem::take(&mut self.pending)
    }

    fn held_tail(&self) -> usize {
        let p = &self.pending;
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > best && p.ends_with(&s[..i]) {
                    best = i;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_across_pushes() {
        let mut m = StopMatcher::new(&["END".into(), "\n\n".into()]);
        assert_eq!(m.push("hello E"), StopOutcome::Continue("hello ".into()));
        assert_eq!(m.push("N"), StopOutcome::Continue(String::new()));
        assert_eq!(m.push("Dx"), StopOutcome::Stopped { text: "EN".replace("EN", ""), stop_index: 0 });
        let mut m = StopMatcher::new(&["ab".into()]);
        assert_eq!(m.push("xa"), StopOutcome::Continue("x".into()));
        assert_eq!(m.finish(), "a");
    }

    proptest::proptest! {
        #[test]
        fn output_is_prefix_before_stop(chunks in proptest::collection::vec("[ab\\n]{0,4}", 0..10)) {
            let mut m = StopMatcher::new(&["abba".into(), "\n\n".into()]);
            let full: String = chunks.concat();
            let mut shown = String::new();
            let mut stopped = false;
            for c in &chunks {
                match m.push(c) {
                    StopOutcome::Continue(t) => shown.push_str(&t),
                    StopOutcome::Stopped { text, .. } => { shown.push_str(&text); stopped = true; break; }
                }
            }
            if !stopped { shown.push_str(&m.finish()); proptest::prop_assert_eq!(&shown, &full); }
            else {
                let first = ["abba", "\n\n"].iter().filter_map(|s| full.find(s)).min();
                proptest::prop_assert_eq!(Some(shown.len()), first);
            }
        }
    }
}
