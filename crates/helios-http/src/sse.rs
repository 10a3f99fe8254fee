//! The streaming half of every generation API. [`respond`] owns what the four protocols
//! share: merging the choices' pieces as they arrive, the order of events (the protocol's
//! opening events, each piece mapped in arrival order, the closing events once every choice
//! ended), usage accounting, ending the stream after the first failure, SSE framing,
//! keep-alives and the request's accounting. A [`Protocol`] only maps pieces to its typed
//! events.

use std::convert::Infallible;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, StreamExt};
use helios_frontend::OutputDelta;
use serde::Serialize;

use crate::error::ApiError;
use crate::generate::{ChoiceEnd, ChoiceRun, Generation, Piece, Tally, logged};

/// How one API presents a streamed generation. Every method appends the events its step
/// produces to `out`; [`respond`] calls them in stream order.
pub(crate) trait Protocol: Send + 'static {
    /// The events before any piece (a role chunk, `message_start`, `response.created`).
    fn open(&mut self, _out: &mut Frames) {}
    /// More output of choice `choice`.
    fn delta(&mut self, choice: u32, delta: OutputDelta, out: &mut Frames);
    /// Choice `choice` ended.
    fn done(&mut self, choice: u32, end: ChoiceEnd, out: &mut Frames);
    /// A choice failed: the protocol's error event. Nothing follows it (no end marker), and
    /// the other choices are cancelled.
    fn failed(&mut self, error: ApiError, out: &mut Frames);
    /// Every choice ended: the closing events (a usage chunk, the end marker), if any.
    fn close(&mut self, _usage: &Tally, _out: &mut Frames) {}
}

/// The events one step produces, framed for SSE.
#[derive(Debug, Default)]
pub(crate) struct Frames(Vec<Event>);

impl Frames {
    /// An event without a name (`data:` only), as OpenAI's chunks are sent.
    pub(crate) fn data(&mut self, body: &impl Serialize) {
        self.0.push(Event::default().data(json_text(body)));
    }

    /// A named event (`event:` then `data:`), as Anthropic's and the Responses API's are.
    pub(crate) fn event(&mut self, name: &'static str, body: &impl Serialize) {
        self.0.push(Event::default().event(name).data(json_text(body)));
    }

    /// OpenAI's end marker, `data: [DONE]`.
    pub(crate) fn done_marker(&mut self) {
        self.0.push(Event::default().data("[DONE]"));
    }

    #[cfg(test)]
    pub(crate) fn count(&self) -> usize {
        self.0.len()
    }
}

/// `body` as compact JSON (one line, as an SSE `data:` field needs). The wire types have
/// string keys and derived impls, so this cannot fail; were one to, the stream goes on
/// without that event rather than panicking mid-response.
pub(crate) fn json_text(body: &impl Serialize) -> String {
    serde_json::to_string(body).unwrap_or_else(|e| {
        tracing::error!("a response body did not serialize: {e}");
        String::from("null")
    })
}

/// All choices' pieces, interleaved as they arrive. Dropping it cancels every choice.
fn merged(choices: Vec<ChoiceRun>) -> BoxStream<'static, (u32, Vec<Piece>)> {
    let streams = choices.into_iter().map(|c| {
        stream::unfold(c, |mut c| async move {
            let pieces = c.next().await?;
            Some(((c.index, pieces), c))
        })
        .boxed()
    });
    stream::select_all(streams).boxed()
}

/// The stream's progress between polls.
struct Run<P> {
    protocol: P,
    pieces: BoxStream<'static, (u32, Vec<Piece>)>,
    usage: Tally,
    ended: bool,
}

impl<P: Protocol> Run<P> {
    /// The events of the next batch of pieces, or the closing events once every choice
    /// ended; `None` after the last.
    async fn step(&mut self) -> Option<Vec<Event>> {
        if self.ended {
            return None;
        }
        let mut out = Frames::default();
        match self.pieces.next().await {
            None => {
                self.ended = true;
                self.protocol.close(&self.usage, &mut out);
            }
            Some((choice, pieces)) => {
                for piece in pieces {
                    match piece {
                        Piece::Delta(delta) => self.protocol.delta(choice, delta, &mut out),
                        Piece::Done(end) => {
                            self.usage.add(&end);
                            self.protocol.done(choice, end, &mut out);
                        }
                        Piece::Failed(error) => {
                            // Dropping `pieces` with this state cancels the other choices.
                            self.ended = true;
                            self.protocol.failed(error, &mut out);
                            break;
                        }
                    }
                }
            }
        }
        Some(out.0)
    }
}

/// The streamed response of `g` as `protocol` presents it. The request counts as answered
/// once the last event was produced; a client that leaves first cancels every choice.
pub(crate) fn respond(g: Generation, mut protocol: impl Protocol) -> Response {
    let mut first = Frames::default();
    protocol.open(&mut first);
    let run = Run { protocol, pieces: merged(g.choices), usage: Tally::new(g.prompt_tokens), ended: false };
    let rest = stream::unfold(run, |mut run| async move { Some((run.step().await?, run)) });
    let events = stream::iter(first.0).chain(rest.flat_map(stream::iter));
    Sse::new(logged(events, g.log).map(Ok::<_, Infallible>)).keep_alive(KeepAlive::default()).into_response()
}
