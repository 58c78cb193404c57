//! The API's HTTP/1.1 server: every connection and request bounded in time
//! and number, so that slow or abandoned clients cannot pile up.
//!
//! - **Header timeout** ([`Limits::header_timeout`]): a request's header must
//!   arrive whole within it, and an idle keep-alive connection is closed
//!   after it (hyper's header read timer runs while it waits for the next
//!   request). A client that sends half a header and stops is closed.
//! - **Request timeout** ([`Limits::request_timeout`]): a request whose
//!   body or answer takes longer is answered 408 `request_timeout`.
//! - **Connections** ([`Limits::max_connections`]): no more are accepted
//!   until one closes; the kernel's backlog holds the rest.
//!
//! A shutdown stops accepting, lets each connection finish the request it
//! is serving, and closes it.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::ApiError;

/// The server's bounds (`[daemon]` keys of the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub header_timeout: Duration,
    pub request_timeout: Duration,
    pub max_connections: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            header_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connections: 1024,
        }
    }
}

/// Serves `router` on `listener` until `shutdown`, then waits for the
/// connections to finish their requests.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: CancellationToken,
) {
    let request_timeout = limits.request_timeout;
    let router = router.layer(axum::middleware::from_fn(
        move |req: Request, next: Next| within(request_timeout, req, next),
    ));
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections as usize));
    let connections = TaskTracker::new();
    loop {
        let permit = tokio::select! {
            () = shutdown.cancelled() => break,
            p = Arc::clone(&slots).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "the API could not accept a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let shutdown = shutdown.clone();
        let header_timeout = limits.header_timeout;
        connections.spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                () = shutdown.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}

/// A request that takes longer than `limit` (reading its body, or the
/// store answering) is answered 408 with the JSON error body.
async fn within(limit: Duration, req: Request, next: Next) -> Response {
    match tokio::time::timeout(limit, next.run(req)).await {
        Ok(response) => response,
        Err(_) => ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            format!(
                "the request took longer than {}",
                humantime::format_duration(limit)
            ),
        )
        .into_response(),
    }
}
