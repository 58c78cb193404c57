//! The outside world as an attempt's external effects reach it: an email
//! transport and a set of HTTP providers, each behind a trait.
//!
//! The daemon hands every queue's [`Scope`](super::Scope) the transports of
//! jobs.toml ([`Mailer`](super::email::Mailer) and
//! [`Providers`](super::http::Providers)); `khata verify` hands each attempt
//! a recorder that implements the same traits and sends nothing. The fence
//! protocol ([`super::fenced`]) sees only these traits, so it runs the same
//! way against either.

use async_trait::async_trait;

use super::EffectError;
use super::email::{Mail, SendError};
use super::http::{HttpError, HttpRequest, HttpResponse};

/// Where email goes.
#[async_trait]
pub trait MailTransport: Send + Sync {
    /// Whether repeating a send with the same Message-ID is harmless (the
    /// transport drops the repeat by itself).
    fn idempotent(&self) -> bool;

    /// Whether a message may be sent as `from`.
    fn allows_sender(&self, from: &str) -> bool;

    /// Sends `mail` under this Message-ID; `key` is the effect's key.
    async fn send(&self, key: &str, mail: &Mail, message_id: &str) -> Result<(), SendError>;

    /// Reconciliation: `Some(true)` if the transport can tell the message
    /// was delivered, `Some(false)` if it can tell it was not, `None` if it
    /// cannot know.
    async fn lookup(&self, key: &str, message_id: &str) -> Option<bool>;
}

/// Where HTTP requests go: the providers, by name.
#[async_trait]
pub trait HttpTransport: Send + Sync {
    /// Checks a request to `provider` without sending it: `denied` when
    /// there is no such provider, `invalid` when the request is malformed.
    fn check(&self, provider: &str, request: &HttpRequest) -> Result<(), EffectError>;

    /// Whether `provider` deduplicates requests by key by itself.
    fn idempotent(&self, provider: &str) -> bool;

    /// Sends `request` to `provider`. Any status is a response.
    async fn send(
        &self,
        provider: &str,
        key: &str,
        fencing_token: u64,
        request: &HttpRequest,
    ) -> Result<HttpResponse, HttpError>;

    /// Asks `provider` whether the request of `key` happened: `None` when
    /// it cannot be asked, `Some(Ok(Some(response)))` when it did,
    /// `Some(Ok(None))` when it did not.
    async fn reconcile(
        &self,
        provider: &str,
        key: &str,
        fencing_token: u64,
    ) -> Option<Result<Option<HttpResponse>, HttpError>>;
}
