//! The operator dashboard (docs/api.md#the-dashboard): one static page with its script and
//! style, embedded in the binary (no build step). The page holds no data: the
//! browser reads the JSON API with the operator's token, which the page asks
//! for when the API answers 401. So these three routes need no token, and
//! everything they serve is the same for every caller.
//!
//! The policy forbids inline script and style, any origin but this one, and
//! framing: even markup smuggled into the page could not run.

use axum::Router;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;

const PAGE: &str = include_str!("../../assets/dashboard/index.html");
const SCRIPT: &str = include_str!("../../assets/dashboard/dashboard.js");
const STYLE: &str = include_str!("../../assets/dashboard/dashboard.css");

/// The Content-Security-Policy of the dashboard's responses.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// `GET /`, `GET /dashboard.js`, `GET /dashboard.css`: outside the auth layer.
pub fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", PAGE) }),
        )
        .route(
            "/dashboard.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
        .route(
            "/dashboard.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::X_FRAME_OPTIONS, "DENY"),
            (header::REFERRER_POLICY, "no-referrer"),
            // Revalidated on each load: a new binary serves its own page.
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
