//! The error type shared by the bench and load drivers.

/// Everything that can stop a bench or load run before it produces a report.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The `--url` argument is not a plain `http://host[:port][/prefix]` URL.
    #[error("invalid url {url:?}: {reason}")]
    Url { url: String, reason: String },
    /// TCP connect or socket setup failed.
    #[error("connect to {addr} failed: {source}")]
    Connect {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The HTTP exchange failed at the transport level.
    #[error("http error: {0}")]
    Http(#[from] hyper::Error),
    /// A request could not be built (bad header value or URI).
    #[error("could not build request: {0}")]
    Request(#[from] hyper::http::Error),
    /// The server answered with a non-success status where success was required.
    #[error("{what}: HTTP {status}: {body}")]
    Status { what: String, status: u16, body: String },
    /// The server's answer did not follow the protocol (bad JSON, missing fields, broken stream).
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A request did not finish in time.
    #[error("timed out: {0}")]
    Timeout(String),
    /// A JSON document could not be parsed or produced.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}
