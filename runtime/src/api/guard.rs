//! Who may ask: the checks a request passes before any route sees it, so
//! that a web page open in the operator's browser can neither read nor
//! change the daemon (docs/security.md).
//!
//! - **Host.** A request's `Host` must be an IP address (the listen address
//!   or any other: a page's origin is then that address, not its own),
//!   `localhost`, or a name in `[daemon] allowed_hosts`. A page that rebinds
//!   its own DNS name to 127.0.0.1 sends its name and gets 421.
//! - **Origin.** When a browser says where the request comes from
//!   (`Origin`), it must be the daemon's own origin, `http(s)://<Host>`:
//!   else 403. `Origin: null` (a sandboxed frame, a file) is refused too.
//! - **Content type.** A `POST`, `PUT` or `PATCH` must say
//!   `Content-Type: application/json`: the forms and `no-cors` fetches a
//!   page can send without the daemon's consent cannot, so even a browser
//!   that sent no `Origin` cannot make a cross-site change. (A cross-site
//!   `DELETE` needs a CORS preflight, which the daemon never grants.)
//!
//! `/healthz` and `/readyz` skip the checks: probes and load balancers name
//! the daemon however they reach it, and the two answer nothing secret.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::ApiError;

/// The names, beside IP addresses and `localhost`, that requests may give
/// as their `Host` (`[daemon] allowed_hosts`), lower-cased.
#[derive(Debug, Clone, Default)]
pub struct AllowedHosts(Arc<[String]>);

impl AllowedHosts {
    pub fn new(names: &[String]) -> AllowedHosts {
        AllowedHosts(names.iter().map(|n| n.to_ascii_lowercase()).collect())
    }

    /// Whether `host` (a `Host` header's value: name or address, with or
    /// without a port) names this daemon.
    fn allows(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        name.parse::<std::net::IpAddr>().is_ok() || name == "localhost" || self.0.contains(&name)
    }
}

/// The name or address in a `Host` value, without its port or the brackets
/// of an IPv6 address.
fn host_name(host: &str) -> &str {
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// The middleware: refuses what the module's doc says, before the route.
pub async fn check(State(allowed): State<AllowedHosts>, req: Request, next: Next) -> Response {
    if matches!(req.uri().path(), "/healthz" | "/readyz") {
        return next.run(req).await;
    }
    if let Err(e) = refusal(&allowed, req.method(), req.headers()) {
        return e.into_response();
    }
    next.run(req).await
}

fn refusal(allowed: &AllowedHosts, method: &Method, headers: &HeaderMap) -> Result<(), ApiError> {
    let text = |name: header::HeaderName| -> Result<Option<&str>, ApiError> {
        headers
            .get(&name)
            .map(|v| {
                v.to_str().map_err(|_| {
                    ApiError::bad_request(format!("the {name} header is not visible ASCII"))
                })
            })
            .transpose()
    };
    // HTTP/1.0 clients may send no Host; browsers always do.
    let host = text(header::HOST)?;
    if let Some(host) = host
        && !allowed.allows(host)
    {
        return Err(ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "host_not_allowed",
            format!(
                "Host {host:?} does not name this daemon: use its IP address or localhost, \
                 or add the name to [daemon] allowed_hosts"
            ),
        ));
    }
    if let Some(origin) = text(header::ORIGIN)? {
        let own = host.is_some_and(|h| {
            origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"))
                .is_some_and(|o| o.eq_ignore_ascii_case(h))
        });
        if !own {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "origin_not_allowed",
                format!(
                    "a request from the web page at {origin:?} is refused: \
                     only the daemon's own origin may call its API"
                ),
            ));
        }
    }
    if matches!(*method, Method::POST | Method::PUT | Method::PATCH) {
        let json = text(header::CONTENT_TYPE)?.is_some_and(|t| {
            t.split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"))
        });
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "unsupported_media_type",
                format!("{method} needs `Content-Type: application/json`"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(header::HeaderName, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    fn code(method: Method, pairs: &[(header::HeaderName, &str)]) -> Option<&'static str> {
        let allowed = AllowedHosts::new(&["Jobs.Internal".to_owned()]);
        refusal(&allowed, &method, &headers(pairs))
            .err()
            .map(|e| e.code)
    }

    #[test]
    fn host_names_the_daemon_or_is_refused() {
        use header::HOST;
        for ok in [
            "127.0.0.1:7373",
            "127.0.0.1",
            "[::1]:7373",
            "10.1.2.3:80",
            "localhost:7373",
            "LOCALHOST",
            "jobs.internal:7373",
            "JOBS.INTERNAL",
        ] {
            assert_eq!(code(Method::GET, &[(HOST, ok)]), None, "{ok}");
        }
        for bad in [
            "rebind.evil.example",
            "evil.example:7373",
            "localhost.evil",
            "internal:7373",
        ] {
            assert_eq!(
                code(Method::GET, &[(HOST, bad)]),
                Some("host_not_allowed"),
                "{bad}"
            );
        }
        assert_eq!(code(Method::GET, &[]), None, "HTTP/1.0 without Host");
    }

    #[test]
    fn an_origin_other_than_the_daemons_own_is_refused() {
        use header::{HOST, ORIGIN};
        let host = (HOST, "127.0.0.1:7373");
        assert_eq!(
            code(
                Method::GET,
                &[host.clone(), (ORIGIN, "http://127.0.0.1:7373")]
            ),
            None
        );
        assert_eq!(
            code(
                Method::GET,
                &[host.clone(), (ORIGIN, "https://127.0.0.1:7373")]
            ),
            None
        );
        for bad in [
            "https://evil.example",
            "http://127.0.0.1:8080",
            "null",
            "http://127.0.0.1:7373.evil",
        ] {
            assert_eq!(
                code(Method::GET, &[host.clone(), (ORIGIN, bad)]),
                Some("origin_not_allowed"),
                "{bad}"
            );
        }
        assert_eq!(
            code(Method::GET, &[(ORIGIN, "http://x")]),
            Some("origin_not_allowed")
        );
    }

    #[test]
    fn a_change_needs_a_json_content_type() {
        use header::CONTENT_TYPE;
        for m in [Method::POST, Method::PUT, Method::PATCH] {
            assert_eq!(code(m.clone(), &[]), Some("unsupported_media_type"));
            for bad in [
                "text/plain",
                "application/x-www-form-urlencoded",
                "multipart/form-data; boundary=x",
            ] {
                assert_eq!(
                    code(m.clone(), &[(CONTENT_TYPE, bad)]),
                    Some("unsupported_media_type")
                );
            }
            for ok in ["application/json", "Application/JSON; charset=utf-8"] {
                assert_eq!(code(m.clone(), &[(CONTENT_TYPE, ok)]), None);
            }
        }
        assert_eq!(code(Method::DELETE, &[]), None);
        assert_eq!(code(Method::GET, &[]), None);
    }
}
