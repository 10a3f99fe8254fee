//! `Host` header checking: a page on another site can point its own DNS name at 127.0.0.1
//! (DNS rebinding) and so reach a local server from the user's browser; the browser still
//! sends that foreign name as `Host`, which is what gives it away.

use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::{ApiCode, ApiError, Flavor, escape_for_log};

/// Which `Host` values the router serves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum HostPolicy {
    /// Every `Host` value.
    #[default]
    Any,
    /// Loopback names and addresses — `localhost` and `*.localhost`, `127.0.0.0/8`, `[::1]` —
    /// with any port, plus the listed names or addresses (compared without the port, ASCII
    /// case-insensitively). Anything else is answered 403 (`host_not_allowed`) in the route's
    /// error envelope. A request without `Host` is served: browsers always send one, so a
    /// rebinding page cannot leave it out.
    Loopback {
        /// Further accepted hosts (`--allowed-hosts`).
        also: Vec<String>,
    },
}

impl HostPolicy {
    /// The policy for a server bound to `ip` with the `--allowed-hosts` list `allowed`: `*`
    /// in the list turns the check off; otherwise a loopback bind, or any bind given a list,
    /// serves loopback names plus the list, and a non-loopback bind without a list serves
    /// every host (the operator exposed it on purpose and knows its names).
    pub fn for_bind(ip: IpAddr, allowed: &[String]) -> HostPolicy {
        let allowed: Vec<String> =
            allowed.iter().map(|h| h.trim().to_ascii_lowercase()).filter(|h| !h.is_empty()).collect();
        if allowed.iter().any(|h| h == "*") || (!ip.is_loopback() && allowed.is_empty()) {
            return HostPolicy::Any;
        }
        HostPolicy::Loopback { also: allowed.iter().map(|h| strip_port(h).to_owned()).collect() }
    }

    /// Whether a request with this `Host` value is served.
    pub fn allows(&self, host: &str) -> bool {
        match self {
            HostPolicy::Any => true,
            HostPolicy::Loopback { also } => {
                let name = strip_port(host.trim()).to_ascii_lowercase();
                is_loopback_name(&name) || also.contains(&name)
            }
        }
    }
}

/// `host` without a trailing `:port` (`[v6]:port` keeps its brackets).
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

fn is_loopback_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    if name == "localhost" || name.ends_with(".localhost") {
        return true;
    }
    if let Some(v6) = name.strip_prefix('[').and_then(|n| n.strip_suffix(']')) {
        return v6.parse::<Ipv6Addr>().is_ok_and(|ip| IpAddr::V6(ip).to_canonical().is_loopback());
    }
    // Only dotted quads: `127.1` or `2130706433` are valid to some resolvers but no browser
    // sends them as a name it resolved.
    name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Middleware answering 403 to requests whose `Host` (or absolute-form authority) the policy
/// rejects.
pub(crate) async fn check_host(State(policy): State<Arc<HostPolicy>>, req: Request, next: Next) -> Response {
    // Every `Host` header and an absolute-form target's authority (which RFC 9112 ranks
    // above `Host`) must be allowed.
    let rejected = req
        .headers()
        .get_all(header::HOST)
        .iter()
        .find(|v| !v.to_str().is_ok_and(|h| policy.allows(h)))
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .or_else(|| req.uri().authority().filter(|a| !policy.allows(a.as_str())).map(|a| a.as_str().to_owned()));
    match rejected {
        None => next.run(req).await,
        Some(host) => {
            let err = ApiError {
                kind: "permission_error",
                ..ApiError::invalid(
                    ApiCode::HostNotAllowed,
                    None,
                    format!(
                        "the Host `{host}` is not served here; a server bound to a loopback address serves only \
                         loopback names unless started with --allowed-hosts"
                    ),
                )
                .with_status(StatusCode::FORBIDDEN)
                .flavor(Flavor::for_path(req.uri().path()))
            };
            tracing::info!(host = %escape_for_log(&host), "request rejected: Host not allowed (DNS rebinding guard)");
            err.into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_policy_accepts_loopback_names_and_the_list_only() {
        let p = HostPolicy::for_bind("127.0.0.1".parse().expect("ip"), &["Example.internal:9000".into()]);
        for ok in [
            "localhost",
            "LOCALHOST:8000",
            "api.localhost:1",
            "127.0.0.1",
            "127.1.2.3:8000",
            "[::1]",
            "[::1]:8000",
            "[::ffff:127.0.0.1]:80",
            "example.internal",
            "example.internal:1234",
        ] {
            assert!(p.allows(ok), "{ok}");
        }
        for bad in
            ["evil.com", "evil.com:8000", "localhost.evil.com", "10.0.0.1", "[::2]:80", "127.1", "", "0.0.0.0:8000"]
        {
            assert!(!p.allows(bad), "{bad}");
        }
        assert_eq!(HostPolicy::for_bind("127.0.0.1".parse().expect("ip"), &["*".into()]), HostPolicy::Any);
        assert_eq!(HostPolicy::for_bind("0.0.0.0".parse().expect("ip"), &[]), HostPolicy::Any);
        assert!(!HostPolicy::for_bind("0.0.0.0".parse().expect("ip"), &["a.b".into()]).allows("c.d"));
        assert!(HostPolicy::for_bind("::1".parse().expect("ip"), &[]).allows("localhost:80"));
    }
}
