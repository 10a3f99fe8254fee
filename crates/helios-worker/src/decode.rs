//! Turning one choice's sampled tokens into presented output: incremental detokenization,
//! stop strings (presentation only: model history is never trimmed), reasoning and
//! tool-call parsing.

use std::sync::Arc;

use helios_frontend::{
    IncrementalDecoder, OutputDelta, OutputParser, ParsedOutput, StopMatcher, StopOutcome, StopSet, Tokenizer,
};

use crate::error::RequestError;

/// Output of one batch of tokens.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decoded {
    pub deltas: Vec<OutputDelta>,
    /// A stop string matched; the request should be cancelled and end with `stop`.
    pub stopped: bool,
}

/// Where a stop string matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopHit {
    /// Tokens fed up to and including the one whose text completed the stop string: the
    /// output length a client is billed, whatever the device generated before the request's
    /// cancellation landed.
    pub tokens: usize,
    /// The stop string that matched, as the request gave it.
    pub string: String,
}

/// Per-choice decoder. Feed tokens in order with [`push`](Self::push), then [`finish`](Self::finish).
#[derive(Debug)]
pub struct ChoiceDecoder {
    tokenizer: Arc<Tokenizer>,
    detok: IncrementalDecoder,
    stop: StopMatcher,
    parser: OutputParser,
    stopped: Option<StopHit>,
    tokens: usize,
}

impl ChoiceDecoder {
    pub fn new(tokenizer: Arc<Tokenizer>, prompt_tail: &[u32], stop: Arc<StopSet>, parser: OutputParser) -> Self {
        ChoiceDecoder {
            tokenizer,
            detok: IncrementalDecoder::new(prompt_tail, true),
            stop: StopMatcher::with_set(stop),
            parser,
            stopped: None,
            tokens: 0,
        }
    }

    /// Tokens fed so far (the model's history, stop trimming notwithstanding).
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The stop string match, once one happened (its token count and string do not depend on
    /// how tokens were batched into `push` calls).
    pub fn stop_hit(&self) -> Option<&StopHit> {
        self.stopped.as_ref()
    }

    pub fn push(&mut self, ids: &[u32]) -> Result<Decoded, RequestError> {
        let mut out = Decoded::default();
        for &id in ids {
            self.tokens += 1;
            if self.stopped.is_some() {
                continue;
            }
            let text = self.detok.push(&self.tokenizer, id)?;
            if text.is_empty() {
                continue;
            }
            self.present(&text, &mut out)?;
        }
        out.stopped = self.stopped.is_some();
        Ok(out)
    }

    fn present(&mut self, text: &str, out: &mut Decoded) -> Result<(), RequestError> {
        let shown = match self.stop.push(text) {
            StopOutcome::Continue(t) => t,
            StopOutcome::Stopped { text, stop_index } => {
                let string = self.stop.stop_string(stop_index).unwrap_or_default().to_owned();
                self.stopped = Some(StopHit { tokens: self.tokens, string });
                text
            }
        };
        if !shown.is_empty() {
            out.deltas.extend(self.parser.push(&shown)?);
        }
        Ok(())
    }

    /// Everything parsed so far (also after a parse failure).
    pub fn output(&self) -> ParsedOutput {
        self.parser.output().clone()
    }

    /// Flushes held text and ends parsing; returns the last deltas and the whole output.
    pub fn finish(&mut self) -> Result<(Vec<OutputDelta>, ParsedOutput), RequestError> {
        let mut out = Decoded::default();
        if self.stopped.is_none() {
            let tail = self.detok.finish(&self.tokenizer)?;
            if !tail.is_empty() {
                self.present(&tail, &mut out)?;
            }
            let held = self.stop.finish();
            if !held.is_empty() {
                out.deltas.extend(self.parser.push(&held)?);
            }
        }
        out.deltas.extend(self.parser.finish()?);
        Ok((out.deltas, self.parser.output().clone()))
    }
}
