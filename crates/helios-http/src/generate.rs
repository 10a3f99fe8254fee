//! The protocol-neutral part of a generation: prepare, admit every choice, and turn each
//! choice's events into presentation pieces.

use std::sync::Arc;

use helios_frontend::{OutputDelta, OutputError, ParsedOutput, ToolChoice};
use helios_worker::{
    ChoiceDecoder, ChoiceEvent, ChoiceStream, Engine, FinishCause, FinishInfo, GenerationInput, Prepared, RequestError,
    Unavailable,
};

use crate::error::{ApiError, Flavor};

/// What a client sees of one choice.
#[derive(Clone, Debug)]
pub(crate) enum Piece {
    Delta(OutputDelta),
    Done(ChoiceEnd),
    Failed(ApiError),
}

/// The end of one choice.
#[derive(Clone, Debug)]
pub(crate) struct ChoiceEnd {
    pub info: FinishInfo,
    pub parsed: ParsedOutput,
}

impl ChoiceEnd {
    /// OpenAI finish reason.
    pub(crate) fn finish_reason(&self) -> &'static str {
        match self.info.cause {
            FinishCause::Length | FinishCause::PoolExhausted => "length",
            _ if !self.parsed.tool_calls.is_empty() => "tool_calls",
            _ => "stop",
        }
    }
}

/// One admitted choice and its decoder.
#[derive(Debug)]
pub(crate) struct ChoiceRun {
    pub index: u32,
    stream: ChoiceStream,
    decoder: ChoiceDecoder,
    tool_choice: ToolChoice,
    tool_names: Vec<String>,
    flavor: Flavor,
    request_id: String,
    finished: bool,
}

impl ChoiceRun {
    fn fail(&mut self, e: &RequestError) -> Vec<Piece> {
        self.finished = true;
        let err = ApiError::from_request(e).flavor(self.flavor).request_id(&self.request_id);
        err.log(e.stage().as_str());
        vec![Piece::Failed(err)]
    }

    /// Next pieces; `None` after the terminal piece.
    pub(crate) async fn next(&mut self) -> Option<Vec<Piece>> {
        if self.finished {
            return None;
        }
        let event = match self.stream.next().await {
            Some(e) => e,
            None => return Some(self.fail(&RequestError::ChannelClosed)),
        };
        let named = matches!(self.tool_choice, ToolChoice::Named(_));
        let keep = |d: &OutputDelta| !(named && matches!(d, OutputDelta::Content(_)));
        match event {
            ChoiceEvent::Tokens(ids) => match self.decoder.push(&ids) {
                Ok(decoded) => {
                    if decoded.stopped {
                        self.stream.stop();
                    }
                    Some(decoded.deltas.into_iter().filter(keep).map(Piece::Delta).collect())
                }
                Err(e) => Some(self.fail(&e)),
            },
            ChoiceEvent::Finished(info) if info.cause == FinishCause::Cancelled => {
                Some(self.fail(&RequestError::Unavailable(Unavailable::Draining)))
            }
            ChoiceEvent::Finished(info) => {
                // An output limit may cut a tool call or the required call short: that is a
                // `length` finish with what was parsed, not a malformed output.
                let truncated = matches!(info.cause, FinishCause::Length | FinishCause::PoolExhausted);
                let (deltas, mut parsed) = match self.decoder.finish() {
                    Ok(done) => done,
                    Err(RequestError::Output(OutputError::UnterminatedToolCall { .. })) if truncated => {
                        (Vec::new(), self.decoder.output())
                    }
                    Err(e) => return Some(self.fail(&e)),
                };
                if !truncated && let Err(e) = parsed.check_tool_choice(&self.tool_choice, &self.tool_names) {
                    return Some(self.fail(&RequestError::Output(e)));
                }
                self.finished = true;
                if named {
                    parsed.content.clear();
                }
                let mut out: Vec<Piece> = deltas.into_iter().filter(keep).map(Piece::Delta).collect();
                out.push(Piece::Done(ChoiceEnd { info, parsed }));
                Some(out)
            }
            ChoiceEvent::Failed(e) => Some(self.fail(&e)),
        }
    }

    /// Runs to the end; returns the end or the failure.
    pub(crate) async fn collect(mut self) -> Result<ChoiceEnd, ApiError> {
        while let Some(pieces) = self.next().await {
            for p in pieces {
                match p {
                    Piece::Done(end) => return Ok(end),
                    Piece::Failed(e) => return Err(e),
                    Piece::Delta(_) => {}
                }
            }
        }
        Err(ApiError::from_request(&RequestError::ChannelClosed).flavor(self.flavor))
    }
}

/// A prepared, admitted generation.
#[derive(Debug)]
pub(crate) struct Generation {
    pub request_id: String,
    pub prompt_tokens: u32,
    pub choices: Vec<ChoiceRun>,
}

/// Prepares `input` and admits all its choices; errors here precede any response header.
pub(crate) async fn start(
    engine: &Arc<Engine>,
    input: GenerationInput,
    flavor: Flavor,
) -> Result<Generation, ApiError> {
    let request_id = input.request_id.clone();
    let fail = |e: RequestError| {
        let err = ApiError::from_request(&e).flavor(flavor).request_id(&request_id);
        err.log(e.stage().as_str());
        err
    };
    let mut prepared: Prepared = engine.prepare(input).await.map_err(fail)?;
    let mut choices = Vec::with_capacity(prepared.n as usize);
    for index in 0..prepared.n {
        let stream = engine.generate(&mut prepared, index).await.map_err(fail)?;
        choices.push(ChoiceRun {
            index,
            stream,
            decoder: prepared.decoder(engine.frontend()),
            tool_choice: prepared.tool_choice.clone(),
            tool_names: prepared.tool_names(),
            flavor,
            request_id: request_id.clone(),
            finished: false,
        });
    }
    Ok(Generation { request_id, prompt_tokens: prepared.prompt_ids.len() as u32, choices })
}

/// A fresh response id after the protocol's prefix (`chatcmpl-`, `msg_`, …).
pub(crate) fn new_id(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{:012x}{:06x}", t & 0xffff_ffff_ffff, n & 0xff_ffff)
}

/// The unique part of an id made by [`new_id`].
pub(crate) fn id_suffix(id: &str) -> &str {
    id.rsplit(['-', '_']).next().unwrap_or(id)
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}
