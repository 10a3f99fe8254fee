//! Stop strings over presentation text. Model history (token ids) is never touched:
//! the matcher only decides how much of the streamed text to show.
//!
//! [`StopSet`] is an Aho-Corasick automaton over the stop strings' bytes, built once per
//! request (cost linear in their total length) and shared by its choices. A
//! [`StopMatcher`] streams text through it: each byte costs amortized O(1) whatever the
//! number or length of the stop strings, and the held-back tail is the automaton state's
//! depth, so nothing is rescanned.
//!
//! Semantics (independent of how the text is chunked): generation stops at the first
//! position where some stop string ends; of the stop strings ending there, the longest
//! (the one starting earliest) is the match, and the shown text ends where it starts.

use std::sync::Arc;

/// Most stop strings one request may give (the automaton holds one state per byte).
pub const MAX_STOPS: usize = 128;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most stop-string bytes in all: the automaton takes about 36 bytes per byte and lives as
/// long as its request (queue wait included), so this bounds it to about 300 KB.
pub const MAX_STOP_TOTAL_BYTES: usize = 8 << 10;

/// Result of feeding text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// Text safe to show; generation continues.
    Continue(String),
    /// A stop string matched: show this text (everything before the stop) and end.
    /// `stop_index` is the matched string's index in the list given to [`StopSet::new`].
    Stopped { text: String, stop_index: usize },
}

/// One automaton state: the trie node of a stop-string prefix.
#[derive(Clone, Debug)]
struct State {
    /// `edges[first_edge..first_edge + edge_count]`, sorted by byte.
    first_edge: u32,
    edge_count: u16,
    /// Length of the prefix this state stands for.
    depth: u32,
    /// State of the longest proper suffix of this prefix that is also a prefix.
    fail: u32,
    /// Longest stop string that is a suffix of this prefix: (length, index).
    out: Option<(u32, u32)>,
}

/// A trie node while building: (edges sorted by byte, depth, first string ending here).
type TrieNode = (Vec<(u8, u32)>, u32, Option<u32>);

/// Compiled stop strings. Invariants: state 0 is the root; `fail` and `out` follow the
/// Aho-Corasick definitions above; every state but the root has depth ≥ 1.
#[derive(Clone, Debug)]
pub struct StopSet {
    states: Vec<State>,
    edges: Vec<(u8, u32)>,
    /// Strings given, so callers can name the one that matched.
    strings: Vec<String>,
}

impl StopSet {
    /// Compiles `stops` (empty strings are ignored; duplicates keep the first index).
    /// Cost: O(total bytes · log 256) time, at most one state per byte.
    pub fn new(stops: &[String]) -> Self {
        // Trie with per-node edge lists, then flattened.
        let mut nodes: Vec<TrieNode> = vec![(Vec::new(), 0, None)];
        for (index, s) in stops.iter().enumerate() {
            if s.is_empty() {
                continue;
            }
            let mut at = 0usize;
            for &b in s.as_bytes() {
                at = match nodes[at].0.binary_search_by_key(&b, |e| e.0) {
                    Ok(i) => nodes[at].0[i].1 as usize,
                    Err(i) => {
                        let next = nodes.len() as u32;
                        let depth = nodes[at].1 + 1;
                        nodes[at].0.insert(i, (b, next));
                        nodes.push((Vec::new(), depth, None));
                        next as usize
                    }
                };
            }
            nodes[at].2.get_or_insert(index as u32);
        }
        let mut states = Vec::with_capacity(nodes.len());
        let mut edges = Vec::with_capacity(nodes.len().saturating_sub(1));
        for (e, depth, word) in &nodes {
            states.push(State {
                first_edge: edges.len() as u32,
                edge_count: e.len() as u16,
                depth: *depth,
                fail: 0,
                out: word.map(|w| (*depth, w)),
            });
            edges.extend_from_slice(e);
        }
        let mut set = StopSet { states, edges, strings: stops.to_vec() };
        // Breadth-first: a state's fail link and output come from shallower states.
        let mut queue = std::collections::VecDeque::new();
        for &(_, child) in set.edges_of(0) {
            queue.push_back(child);
        }
        while let Some(s) = queue.pop_front() {
            let s = s as usize;
            let range = set.edge_range(s);
            for i in range {
                let (b, child) = set.edges[i];
                let mut f = set.states[s].fail;
                let fail = loop {
                    if let Some(n) = set.step(f, b) {
                        break n;
                    }
                    if f == 0 {
                        break 0;
                    }
                    f = set.states[f as usize].fail;
                };
                let c = child as usize;
                set.states[c].fail = fail;
                if set.states[c].out.is_none() {
                    set.states[c].out = set.states[fail as usize].out;
                }
                queue.push_back(child);
            }
        }
        set
    }

    /// Whether no (non-empty) stop string was given.
    pub fn is_empty(&self) -> bool {
        self.states.len() == 1
    }

    /// The stop string at `index` as given.
    pub fn string(&self, index: usize) -> Option<&str> {
        self.strings.get(index).map(String::as_str)
    }

    fn edge_range(&self, s: usize) -> std::ops::Range<usize> {
        let st = &self.states[s];
        st.first_edge as usize..st.first_edge as usize + st.edge_count as usize
    }

    fn edges_of(&self, s: usize) -> &[(u8, u32)] {
        &self.edges[self.edge_range(s)]
    }

    /// The trie edge from `s` on `b`, if any.
    fn step(&self, s: u32, b: u8) -> Option<u32> {
        let e = self.edges_of(s as usize);
        e.binary_search_by_key(&b, |x| x.0).ok().map(|i| e[i].1)
    }

    /// The automaton transition (trie edge, else fail links).
    fn next(&self, mut s: u32, b: u8) -> u32 {
        loop {
            if let Some(n) = self.step(s, b) {
                return n;
            }
            if s == 0 {
                return 0;
            }
            s = self.states[s as usize].fail;
        }
    }
}

/// Streams text through a shared [`StopSet`], holding back only the tail that could still
/// begin a stop string.
///
/// Invariant: `pending` is exactly the last `depth(state)` bytes of the text fed so far.
#[derive(Clone, Debug)]
pub struct StopMatcher {
    set: Arc<StopSet>,
    state: u32,
    pending: String,
    done: bool,
}

impl StopMatcher {
    /// Compiles `stops` for one matcher; prefer [`StopMatcher::with_set`] to share one set.
    pub fn new(stops: &[String]) -> Self {
        Self::with_set(Arc::new(StopSet::new(stops)))
    }

    pub fn with_set(set: Arc<StopSet>) -> Self {
        StopMatcher { set, state: 0, pending: String::new(), done: false }
    }

    /// Feeds decoded text. After `Stopped`, further input yields empty `Continue`.
    /// Cost: amortized O(1) per byte of `text`.
    pub fn push(&mut self, text: &str) -> StopOutcome {
        if self.done {
            return StopOutcome::Continue(String::new());
        }
        if self.set.is_empty() {
            return StopOutcome::Continue(text.to_string());
        }
        let mut out = std::mem::take(&mut self.pending);
        let start = out.len();
        out.push_str(text);
        for (i, &b) in text.as_bytes().iter().enumerate() {
            self.state = self.set.next(self.state, b);
            if let Some((len, index)) = self.set.states[self.state as usize].out {
                let end = start + i + 1;
                self.done = true;
                out.truncate(end - len as usize);
                return StopOutcome::Stopped { text: out, stop_index: index as usize };
            }
        }
        // A held tail starts where a stop string starts: on a char boundary.
        let depth = self.set.states[self.state as usize].depth as usize;
        self.pending = out.split_off(out.len() - depth);
        StopOutcome::Continue(out)
    }

    /// The stop string at `index` of the set, as given (names a `Stopped` match).
    pub fn stop_string(&self, index: usize) -> Option<&str> {
        self.set.string(index)
    }

    /// Releases held text at the end of generation.
    pub fn finish(&mut self) -> String {
        self.done = true;
        std::mem::take(&mut self.pending)
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
        assert_eq!(m.push("Dx"), StopOutcome::Stopped { text: String::new(), stop_index: 0 });
        let mut m = StopMatcher::new(&["ab".into()]);
        assert_eq!(m.push("xa"), StopOutcome::Continue("x".into()));
        assert_eq!(m.finish(), "a");
    }

    #[test]
    fn earliest_end_then_longest_and_original_indices() {
        // "bc" ends before "abcd" does: it wins however the text is chunked.
        for chunks in [vec!["abcd"], vec!["a", "b", "c", "d"], vec!["ab", "cd"]] {
            let mut m = StopMatcher::new(&["abcd".into(), "".into(), "bc".into()]);
            let mut shown = String::new();
            let mut hit = None;
            for c in chunks {
                match m.push(c) {
                    StopOutcome::Continue(t) => shown.push_str(&t),
                    StopOutcome::Stopped { text, stop_index } => {
                        shown.push_str(&text);
                        hit = Some(stop_index);
                        break;
                    }
                }
            }
            assert_eq!((shown.as_str(), hit), ("a", Some(2)));
        }
        // Same end: the longer string (starting earlier) is the match.
        let mut m = StopMatcher::new(&["c".into(), "abc".into()]);
        assert_eq!(m.push("xabc"), StopOutcome::Stopped { text: "x".into(), stop_index: 1 });
    }

    #[test]
    fn held_tail_is_the_longest_stop_prefix_and_respects_chars() {
        let mut m = StopMatcher::new(&["🚀x".into(), "aab".into()]);
        assert_eq!(m.push("zaa"), StopOutcome::Continue("z".into()));
        assert_eq!(m.push("a"), StopOutcome::Continue("a".into()));
        assert_eq!(m.push("é🚀"), StopOutcome::Continue("aaé".into()));
        assert_eq!(m.finish(), "🚀");
    }

    /// As many stop bytes as a request may give, in strings of the longest length: one
    /// state per byte at most, and a text that keeps every string alive is held back, then
    /// matched, exactly.
    #[test]
    fn many_long_stops_stream_exactly() {
        let stops: Vec<String> = (0..MAX_STOP_TOTAL_BYTES / MAX_STOP_BYTES)
            .map(|i| format!("{i:05}{}", "s".repeat(MAX_STOP_BYTES - 5)))
            .collect();
        let set = Arc::new(StopSet::new(&stops));
        assert!(set.states.len() <= stops.iter().map(String::len).sum::<usize>() + 1);
        let mut m = StopMatcher::with_set(set.clone());
        let text = "00004".to_string() + &"s".repeat(MAX_STOP_BYTES - 6);
        let mut shown = String::new();
        for c in text.as_bytes().chunks(7) {
            match m.push(std::str::from_utf8(c).expect("ascii")) {
                StopOutcome::Continue(t) => shown.push_str(&t),
                StopOutcome::Stopped { .. } => panic!("one byte short of the stop"),
            }
        }
        assert!(shown.is_empty(), "the whole text could still begin stop 4");
        assert_eq!(m.push("s"), StopOutcome::Stopped { text: String::new(), stop_index: 4 });
    }

    /// Reference semantics: the first end position of any stop, longest at that end.
    fn reference(full: &str, stops: &[&str]) -> Option<(usize, usize)> {
        (1..=full.len()).find_map(|end| {
            stops
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.is_empty() && full.is_char_boundary(end) && full[..end].ends_with(*s))
                .max_by_key(|(i, s)| (s.len(), std::cmp::Reverse(*i)))
                .map(|(i, s)| (end - s.len(), i))
        })
    }

    proptest::proptest! {
        #[test]
        fn chunking_never_changes_the_result(
            chunks in proptest::collection::vec("[ab\\né]{0,4}", 0..10),
            stops in proptest::collection::vec("[ab\\né]{0,4}", 1..5),
        ) {
            let stop_strings: Vec<String> = stops.clone();
            let refs: Vec<&str> = stops.iter().map(String::as_str).collect();
            let mut m = StopMatcher::new(&stop_strings);
            let full: String = chunks.concat();
            let mut shown = String::new();
            let mut hit = None;
            for c in &chunks {
                match m.push(c) {
                    StopOutcome::Continue(t) => shown.push_str(&t),
                    StopOutcome::Stopped { text, stop_index } => { shown.push_str(&text); hit = Some(stop_index); break; }
                }
            }
            match reference(&full, &refs) {
                None => {
                    proptest::prop_assert_eq!(hit, None);
                    shown.push_str(&m.finish());
                    proptest::prop_assert_eq!(&shown, &full);
                }
                Some((pos, index)) => {
                    proptest::prop_assert_eq!(shown.len(), pos);
                    // Duplicated strings report their first index.
                    proptest::prop_assert_eq!(Some(refs.iter().position(|s| *s == refs[index]).unwrap_or(index)), hit);
                }
            }
        }
    }
}
