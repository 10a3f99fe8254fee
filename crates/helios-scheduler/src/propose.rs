//! Copy proposals for speculative decoding, taken from the request's own history.
//!
//! Agents copy: a file comes back edited, a tool result is quoted, a JSON object repeats with
//! one field changed. [`CopyProposer`] finds the most recent earlier occurrence of the
//! history's longest suffix (between `min_n` and `max_n` tokens) and proposes what followed it.
//! It is model-free and incremental: each committed token costs `max_n - min_n + 1` hash-map
//! updates, and a proposal is a slice of the history.
//!
//! [`DepthController`] decides how deep to propose for one request: it keeps a running estimate
//! of the chance that a proposed token is accepted and picks the depth whose expected tokens
//! per step, over the cost of verifying that many rows on this core, is best; depth 0 (no
//! speculation) whenever nothing beats plain decoding.

use std::collections::HashMap;

/// Incremental longest-suffix-match proposer over one request's committed tokens.
///
/// Invariant: `last[k]` maps the hash of every `(min_n + k)`-gram of `tokens` that ends before
/// the last token to the end of its most recent occurrence (exclusive); `matched` is the end of
/// the most recent earlier occurrence of the longest suffix that has one.
#[derive(Clone, Debug)]
pub struct CopyProposer {
    min_n: usize,
    max_n: usize,
    /// Matches look back at most this far (at least `window`, fewer than `2 * window` tokens
    /// are indexed): memory stays bounded on long contexts.
    window: usize,
    /// Tokens committed since creation, indexed or not.
    committed: usize,
    tokens: Vec<u32>,
    last: Vec<HashMap<u64, usize>>,
    matched: Option<usize>,
}

fn hash(window: &[u32]) -> u64 {
    window.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| (h ^ u64::from(t)).wrapping_mul(0x0100_0000_01b3))
}

impl CopyProposer {
    /// A proposer matching suffixes of `min_n..=max_n` tokens (`1 <= min_n <= max_n`).
    pub fn new(min_n: usize, max_n: usize) -> Self {
        let min_n = min_n.max(1);
        let max_n = max_n.max(min_n);
        CopyProposer {
            min_n,
            max_n,
            window: usize::MAX / 2,
            committed: 0,
            tokens: Vec::new(),
            last: vec![HashMap::new(); max_n - min_n + 1],
            matched: None,
        }
    }

    /// Looks back over at least the last `window` tokens only (more than `max_n`): once
    /// `2 * window` are indexed, the index is rebuilt over the last `window` (amortized
    /// constant work per token, memory linear in `window`).
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window.max(self.max_n + 1);
        self
    }

    /// A proposer over `history` (prompt and anything committed), indexing only its last
    /// `window` tokens.
    pub fn with_history(mut self, history: &[u32]) -> Self {
        let skipped = history.len().saturating_sub(self.window);
        self.extend(&history[skipped..]);
        self.committed += skipped;
        self
    }

    /// Tokens committed so far that matches can look back over.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Tokens committed since creation (the window may have let the oldest go).
    pub fn committed(&self) -> usize {
        self.committed
    }

    /// Whether nothing was committed.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Commits tokens (prompt, tool results, accepted output) in order.
    pub fn extend(&mut self, tokens: &[u32]) {
        for &t in tokens {
            self.push(t);
        }
    }

    /// Commits one token.
    pub fn push(&mut self, token: u32) {
        if self.tokens.len() + 1 >= 2 * self.window {
            let keep = self.tokens.split_off(self.tokens.len() - self.window);
            let mut fresh = CopyProposer::new(self.min_n, self.max_n).with_window(self.window);
            fresh.extend(&keep);
            fresh.committed = self.committed;
            *self = fresh;
        }
        self.committed += 1;
        self.tokens.push(token);
        let end = self.tokens.len();
        self.matched = None;
        // Longest first: the first n whose suffix occurred before gives the match.
        for n in (self.min_n..=self.max_n.min(end)).rev() {
            let key = hash(&self.tokens[end - n..]);
            let map = &mut self.last[n - self.min_n];
            if let Some(prev) = map.insert(key, end)
                && self.matched.is_none()
                && self.tokens[prev - n..prev] == self.tokens[end - n..]
            {
                self.matched = Some(prev);
            }
        }
    }

    /// Up to `depth` proposed next tokens: what followed the most recent earlier occurrence of
    /// the longest matching suffix. Empty without a match.
    pub fn propose(&self, depth: usize) -> &[u32] {
        match self.matched {
            Some(start) => &self.tokens[start..(start + depth).min(self.tokens.len())],
            None => &[],
        }
    }
}

/// Chooses a request's proposal depth from its observed acceptance and the verification cost of
/// the batch it decodes in.
///
/// Model: each proposed token is accepted with probability `p` independently, so depth `d`
/// yields `1 + p + p² + … + p^d` tokens per step (the bonus token included) at a cost of
/// `cost[d]` plain decode steps. The estimate of `p` is an exponentially weighted average of
/// the observed per-token acceptance, starting optimistic so a request gets to try. The cost
/// is an argument, not state: it depends on how many requests share the round (a core's
/// programs for four requests verify fewer proposals, at another price, than for one).
#[derive(Clone, Debug)]
pub struct DepthController {
    acceptance: f64,
    prior: f64,
    /// Weight of a new observation.
    alpha: f64,
}

/// How far [`DepthController::relax`] moves the estimate back toward the prior per step: a
/// request that stopped proposing tries again after some tens of steps.
const RELAX: f64 = 0.02;

/// Expected tokens of a round that verifies `d` proposals, each accepted with probability `p`
/// (a geometric prefix, plus the bonus token).
pub fn expected_tokens(p: f64, d: usize) -> f64 {
    (0..=d).map(|k| p.powi(k as i32)).sum()
}

impl DepthController {
    /// A controller starting from acceptance estimate `prior`.
    pub fn new(prior: f64) -> Self {
        let prior = prior.clamp(0.0, 1.0);
        DepthController { acceptance: prior, prior, alpha: 0.2 }
    }

    /// The current acceptance estimate.
    pub fn acceptance(&self) -> f64 {
        self.acceptance
    }

    /// The depth to propose next (0: decode without speculation), at most `available` (the
    /// proposer's match length) and at most `cost.len() - 1`. `cost[d]`: a round verifying `d`
    /// proposals over a plain decode step of the same batch (`cost[0]` is taken as 1). Costs
    /// O(`available`).
    pub fn depth(&self, available: usize, cost: &[f64]) -> usize {
        let max = available.min(cost.len().saturating_sub(1));
        let rate = |d: usize| expected_tokens(self.acceptance, d) / if d == 0 { 1.0 } else { cost[d].max(1.0) };
        (0..=max).max_by(|&a, &b| rate(a).total_cmp(&rate(b)).then(b.cmp(&a))).unwrap_or(0)
    }

    /// A step decoded without proposals: the estimate drifts back toward the prior, so a
    /// request whose text became repetitive later gets to propose again (nothing is observed
    /// while nothing is proposed).
    pub fn relax(&mut self) {
        self.acceptance += RELAX * (self.prior - self.acceptance);
    }

    /// Records a verification: `accepted` of `proposed` tokens were accepted (a prefix).
    pub fn observe(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        // Per-token acceptance of a geometric prefix: accepted / (accepted + 1 rejection), or
        // all accepted.
        let sample = if accepted >= proposed { 1.0 } else { accepted as f64 / (accepted as f64 + 1.0) };
        self.acceptance += self.alpha * (sample - self.acceptance);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Brute force: the most recent earlier occurrence of the longest suffix in `min..=max`.
    fn brute(tokens: &[u32], min_n: usize, max_n: usize, depth: usize) -> Vec<u32> {
        let end = tokens.len();
        for n in (min_n..=max_n.min(end)).rev() {
            let suffix = &tokens[end - n..];
            for prev in (n..end).rev() {
                if &tokens[prev - n..prev] == suffix {
                    return tokens[prev..(prev + depth).min(end)].to_vec();
                }
            }
        }
        Vec::new()
    }

    #[test]
    fn proposes_what_followed_the_last_occurrence() {
        let mut p = CopyProposer::new(2, 4);
        // "a b c d x a b c" -> suffix "a b c" occurred before, followed by "d x a".
        p.extend(&[1, 2, 3, 4, 9, 1, 2, 3]);
        assert_eq!(p.propose(3), &[4, 9, 1]);
        assert_eq!(p.propose(0), &[] as &[u32]);
        p.push(7); // "c 7" never occurred
        assert_eq!(p.propose(3), &[] as &[u32]);
    }

    #[test]
    fn incremental_matching_equals_brute_force() {
        let mut seed = 0x1234_5678_u64;
        for case in 0..200 {
            let (min_n, max_n) = (1 + case % 3, 2 + case % 5);
            let vocab = 2 + (case % 6) as u64;
            let mut p = CopyProposer::new(min_n, max_n);
            let mut tokens = Vec::new();
            for _ in 0..120 {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let t = ((seed >> 33) % vocab) as u32;
                tokens.push(t);
                p.push(t);
                assert_eq!(p.propose(5), brute(&tokens, min_n, max_n.max(min_n), 5).as_slice(), "case {case}");
            }
        }
    }

    #[test]
    fn a_window_bounds_the_index_and_keeps_recent_matches() {
        let mut seed = 0x9e37_79b9_u64;
        let (min_n, max_n, window) = (2, 4, 50);
        let mut p = CopyProposer::new(min_n, max_n).with_window(window);
        let mut tokens = Vec::new();
        for _ in 0..1000 {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            let t = ((seed >> 33) % 5) as u32;
            tokens.push(t);
            p.push(t);
            assert!(p.len() < 2 * window && p.len() >= window.min(tokens.len()));
            // What the proposer indexes is the tail of the history, and it proposes from it
            // exactly as from a history that starts there.
            let tail = &tokens[tokens.len() - p.len()..];
            assert_eq!(p.propose(3), brute(tail, min_n, max_n, 3).as_slice());
        }
    }

    #[test]
    fn depth_follows_acceptance_and_cost() {
        // Verifying d proposals costs 1 + 0.1 d decode steps.
        let cost: Vec<f64> = (0..8).map(|d| 1.0 + 0.1 * d as f64).collect();
        let mut c = DepthController::new(0.9);
        assert_eq!(c.depth(7, &cost), 7, "high acceptance: as deep as the proposer reaches");
        assert_eq!(c.depth(3, &cost), 3, "never deeper than the match");
        assert_eq!(c.depth(7, &cost[..4]), 3, "never deeper than the batch's programs verify");
        assert_eq!(c.depth(7, &cost[..1]), 0, "no program for the batch: plain decoding");
        for _ in 0..40 {
            c.observe(4, 0);
        }
        assert!(c.acceptance() < 0.01);
        assert_eq!(c.depth(7, &cost), 0, "nothing accepted: plain decoding");
        for _ in 0..40 {
            c.observe(4, 4);
        }
        assert!(c.depth(7, &cost) > 0, "acceptance recovered");
        for _ in 0..40 {
            c.observe(4, 0);
        }
        assert_eq!(c.depth(7, &cost), 0);
        for _ in 0..200 {
            c.relax();
        }
        assert!(c.depth(7, &cost) > 0, "steps without proposals bring the estimate back to try again");
        // On a core where verification costs as much as the tokens it can yield, never.
        let expensive: Vec<f64> = (0..8).map(|d| 1.0 + d as f64).collect();
        assert_eq!(DepthController::new(0.95).depth(7, &expensive), 0);
        // The same acceptance pays in a cheap batch and not in a dear one.
        let p = DepthController::new(0.5);
        assert!(p.depth(7, &cost) > 0);
        assert_eq!(p.depth(7, &[1.0, 1.6, 1.9, 2.2]), 0);
        assert!((expected_tokens(0.5, 2) - 1.75).abs() < 1e-12);
    }
}
