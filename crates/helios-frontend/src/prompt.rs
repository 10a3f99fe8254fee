//! Full prompt preparation and the shared byte-mark -> token-endpoint mapping.

use crate::cancel::Cancel;
use crate::error::FrontendError;
use crate::template::{ChatTemplate, RenderInput, RenderLimits};
use crate::tokenizer::{Encoded, Tokenizer};

/// A rendered, tokenized prompt with the checkpoint endpoints the scheduler consumes.
///
/// Invariant: `checkpoints` is sorted, unique, and every entry `k` satisfies
/// `0 < k < ids.len()`; the first `k` tokens encode exactly `text[..mark]` for some
/// completed-message byte mark.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub message_ends: Vec<usize>,
    pub checkpoints: Vec<usize>,
}

impl Prompt {
    /// Renders `input` once (plus prefix renders for marks), encodes it without adding
    /// special tokens (as Transformers does for chat prompts) and maps the marks.
    pub fn prepare(template: &ChatTemplate, tokenizer: &Tokenizer, input: &RenderInput) -> Result<Self, FrontendError> {
        Self::prepare_with(template, tokenizer, input, None, &Cancel::default())
    }

    /// [`prepare`](Self::prepare) bounded by the context limit `context` and a cancellation
    /// flag, cheapest check first: the render stops once it passes the tokenizer's byte bound
    /// for `context` tokens; the text is encoded and refused when it has `context` tokens or
    /// more (no room for output); only then are checkpoint marks probed. Cancellation stops
    /// the render and the probes.
    pub fn prepare_with(
        template: &ChatTemplate,
        tokenizer: &Tokenizer,
        input: &RenderInput,
        context: Option<usize>,
        cancel: &Cancel,
    ) -> Result<Self, FrontendError> {
        let limits =
            RenderLimits { cancel: cancel.clone(), max_bytes: context.and_then(|n| tokenizer.max_text_bytes(n)) };
        let text = template.render_text_with(input, &limits)?;
        if cancel.is_cancelled() {
            return Err(crate::error::TemplateError::Cancelled.into());
        }
        let enc = tokenizer.encode(&text, false)?;
        if let Some(limit) = context.filter(|&l| enc.ids.len() >= l) {
            return Err(FrontendError::ContextLimit { tokens: enc.ids.len(), limit });
        }
        let message_ends = template.marks_with(input, &text, cancel)?;
        let checkpoints = checkpoint_endpoints(&message_ends, &enc);
        Ok(Prompt { text, ids: enc.ids, message_ends, checkpoints })
    }
}

/// Converts byte marks into token endpoints. A mark `b` yields endpoint `k` only when
/// every token before `k` ends at or before `b` and every token from `k` on starts at or
/// after `b`; marks crossed by a token yield nothing. Result: sorted, deduplicated,
/// strictly inside `(0, ids.len())`.
pub fn checkpoint_endpoints(marks: &[usize], enc: &Encoded) -> Vec<usize> {
    let n = enc.offsets.len();
    // prefix_end[k] = max end of tokens[..k]; suffix_start[k] = min start of tokens[k..].
    let mut prefix_end = vec![0usize; n + 1];
    for (i, o) in enc.offsets.iter().enumerate() {
        prefix_end[i + 1] = prefix_end[i].max(o.1);
    }
    let mut suffix_start = vec![usize::MAX; n + 1];
    for i in (0..n).rev() {
        suffix_start[i] = suffix_start[i + 1].min(enc.offsets[i].0);
    }
    let mut out: Vec<usize> = marks
        .iter()
        .filter_map(|&b| {
            let k = prefix_end.partition_point(|&e| e <= b).checked_sub(1)?;
            (k > 0 && k < n && suffix_start[k] >= b).then_some(k)
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(offsets: &[(usize, usize)]) -> Encoded {
        Encoded { ids: (0..offsets.len() as u32).collect(), offsets: offsets.to_vec() }
    }

    #[test]
    fn exact_cuts_only() {
        let e = enc(&[(0, 3), (3, 5), (5, 9), (9, 12)]);
        assert_eq!(checkpoint_endpoints(&[3, 4, 9, 9, 12, 0], &e), vec![1, 3]);
    }

    #[test]
    fn overlapping_unicode_spans_do_not_cut() {
        // Two byte-level tokens of one 4-byte char share the char's span.
        let e = enc(&[(0, 2), (2, 6), (2, 6), (6, 8)]);
        assert_eq!(checkpoint_endpoints(&[2, 4, 6], &e), vec![1, 3]);
    }

    proptest::proptest! {
        #[test]
        fn endpoints_are_valid(lens in proptest::collection::vec(0usize..5, 1..40), marks in proptest::collection::vec(0usize..120, 0..20)) {
            let mut offs = Vec::new();
            let mut p = 0;
            for l in lens { offs.push((p, p + l)); p += l; }
            let e = enc(&offs);
            let out = checkpoint_endpoints(&marks, &e);
            for w in out.windows(2) { proptest::prop_assert!(w[0] < w[1]); }
            for &k in &out {
                proptest::prop_assert!(k > 0 && k < offs.len());
                let b = offs[k - 1].1;
                proptest::prop_assert!(marks.contains(&b) || offs[k].0 == b);
                proptest::prop_assert!(offs[..k].iter().all(|o| o.1 <= offs[k].0));
            }
        }
    }
}
