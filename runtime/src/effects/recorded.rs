//! What `khata verify` (see `crate::verify`) runs a handler against.
//!
//! Verify builds each attempt's [`Scope`](super::Scope) with a recorder as
//! its email transport and HTTP providers ([`super::outside`]'s traits): it
//! sends nothing, notes every delivery and answers with a plausible success
//! ([`http_answer`] for HTTP, the Message-ID for email). The fence protocol
//! around it is the daemon's own, on a real store. A [`Watch`] installed with
//! [`Effects::watched`](super::Effects::watched) also sees every step of the
//! attempt's effects and may stop it at one, as a crash would.
//!
//! The daemon never installs a watch and never builds a recorder, so
//! nothing here is reachable from a daemon's attempt.

use sha2::{Digest, Sha256};

use super::http::HttpResponse;

/// Where in one effect a step is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Point {
    /// The handler asked for the effect; nothing is in the ledger yet.
    BeforeStarted,
    /// External effects only: the fence is `started` and the provider has
    /// received the request, but its result is not recorded (`done`) yet.
    Started,
    /// The effect is recorded: the fence is `done`, or the kv/index step is
    /// applied.
    Done,
}

impl Point {
    pub fn as_str(self) -> &'static str {
        match self {
            Point::BeforeStarted => "before started",
            Point::Started => "between started and done",
            Point::Done => "after done",
        }
    }
}

/// One step of an effect, as a watch sees it.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    /// `email`, `http`, `kv` or `index`.
    pub kind: &'a str,
    /// The effect's key (for kv, the kv key; for index, `collection/id`).
    pub key: &'a str,
    /// The fingerprint of the request (docs/fences.md#the-fence), or of the write for kv and index.
    pub fingerprint: &'a [u8],
    pub point: Point,
}

/// Sees the steps and outcomes of one attempt's effects.
pub trait Watch: Send + Sync {
    /// Called at every step. `true` stops the attempt there: the effect call
    /// never returns, and whoever runs the attempt drops it, leaving the
    /// ledger as a crash at that point would.
    fn stop_at(&self, step: &Step<'_>) -> bool;

    /// How a call ended: `performed`, `replayed`, `reconciled:done`,
    /// `refused:<reason>`, or `applied` for kv and index writes.
    fn outcome(&self, kind: &str, key: &str, outcome: &str);
}

/// The response a recorder gives to an HTTP effect: `200` with a JSON body
/// naming a charge-like object derived from the provider and key only, so
/// that every run receives the same bytes for the same key.
pub fn http_answer(provider: &str, key: &str) -> HttpResponse {
    let mut h = Sha256::new();
    h.update(provider.as_bytes());
    h.update([0]);
    h.update(key.as_bytes());
    let id = format!("rec_{}", &hex::encode(h.finalize())[..16]);
    HttpResponse {
        status: 200,
        headers: vec![("content-type".into(), "application/json".into())],
        body: serde_json::json!({ "id": id, "status": "succeeded", "recorded": true })
            .to_string()
            .into_bytes(),
    }
}
