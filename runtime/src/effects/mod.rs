//! What a handler may do to the world, and the checks on every call.
//!
//! An [`Effects`] value belongs to one attempt. Every call is checked, in
//! this order, before anything happens:
//!
//! 1. the queue's grants (docs/wit.md#the-sandbox; the grants: docs/jobs-toml.md#grants): a call without a grant is `denied`;
//! 2. the request's shape (sizes, names): a malformed one is `invalid`;
//! 3. the attempt's lease, inside the same store step as the effect: an
//!    attempt that no longer holds its job is `fenced` and changes nothing.
//!
//! The embedded effects (kv, index) are single store steps, idempotent by
//! nature, and need no fence of their own. The external effects (email,
//! http) go through [`fenced`]: a durable fence per idempotency key, so that
//! each happens once, or is reported `uncertain` where once cannot be known.
//!
//! This module knows nothing of wasmtime: the host maps its types to the WIT.

pub mod email;
pub mod fenced;
pub mod http;
pub mod outside;
pub mod recorded;

use std::sync::{Arc, OnceLock};

use crate::clock::Clock;
use crate::config::{Grants, OnUncertain};
use crate::job::{LeaseRef, Millis};
use crate::store::RESOLVED_BY_OPERATOR;
use crate::store::{
    Doc, DocId, EffectRecord, KvPut, PutMode, Store, StoreError, Tombstone, UpsertOutcome,
};
use email::{Mail, SendError};
use fenced::{Effect, Fenced, Reconciled, Tried};
use http::{HttpError, HttpRequest, HttpResponse};
use outside::{HttpTransport, MailTransport};
use recorded::{Point, Step, Watch};

/// Largest kv key or index id, in bytes.
pub const MAX_KEY: usize = 1024;
/// Refused effect calls recorded per attempt (see `Effects::refused`).
pub const MAX_REFUSALS_RECORDED: u32 = 32;
/// Recipients (to and cc) of one email.
pub const MAX_RECIPIENTS: usize = 50;
/// Bytes of an email's subject.
pub const MAX_SUBJECT: usize = 998;
/// Largest kv value or index document, in bytes.
pub const MAX_VALUE: usize = 1 << 20;

/// Why an effect was not performed; mirrors the WIT `effect-error`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EffectError {
    #[error("denied: {0}")]
    Denied(String),
    #[error("key reused: {0}")]
    KeyReused(String),
    #[error("in progress: {0}")]
    InProgress(String),
    #[error("fenced: {0}")]
    Fenced(String),
    #[error("uncertain: {0}")]
    Uncertain(String),
    #[error("transient: {0}")]
    Transient(String),
    #[error("rejected: {0}")]
    Rejected(String),
    #[error("invalid: {0}")]
    Invalid(String),
}

impl EffectError {
    /// The WIT case name: `denied`, `key-reused`, ...
    pub fn reason(&self) -> &'static str {
        match self {
            EffectError::Denied(_) => "denied",
            EffectError::KeyReused(_) => "key-reused",
            EffectError::InProgress(_) => "in-progress",
            EffectError::Fenced(_) => "fenced",
            EffectError::Uncertain(_) => "uncertain",
            EffectError::Transient(_) => "transient",
            EffectError::Rejected(_) => "rejected",
            EffectError::Invalid(_) => "invalid",
        }
    }
}

impl From<StoreError> for EffectError {
    fn from(e: StoreError) -> EffectError {
        match e {
            StoreError::Fenced { .. } => EffectError::Fenced(e.to_string()),
            StoreError::Unavailable(_) => EffectError::Transient(e.to_string()),
            other => EffectError::Invalid(other.to_string()),
        }
    }
}

/// What the attempts of one queue may reach: its grants, policy and the
/// outside world (the transports configured for the daemon, or under
/// `khata verify` a recorder's).
#[derive(Clone)]
pub struct Scope {
    pub queue: String,
    pub namespace: String,
    pub grants: Grants,
    pub on_uncertain: OnUncertain,
    /// `Err` when the email transport could not be set up (the error says why).
    pub mailer: Result<Arc<dyn MailTransport>, String>,
    pub providers: Arc<dyn HttpTransport>,
    /// The From address used when a message names none.
    pub email_from: String,
    /// The daemon's time: the dates of fences and effect records.
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scope")
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// The effects of one attempt.
pub struct Effects {
    store: Arc<dyn Store>,
    scope: Arc<Scope>,
    queue: String,
    namespace: String,
    grants: Grants,
    on_uncertain: OnUncertain,
    lease: LeaseRef,
    /// Set by an effect whose outcome is unknown under `on_uncertain =
    /// "dead"` (the first such effect's reason is kept): the attempt then
    /// ends its job in the dead-letter queue, whatever the handler returns.
    dead: OnceLock<String>,
    /// Refused effect calls of this attempt so far.
    refusals: std::sync::atomic::AtomicU32,
    /// Set only by [`Effects::watched`] (`khata verify`): sees every step
    /// and outcome of the attempt's effects and may stop it at one.
    watch: Option<Arc<dyn Watch>>,
}

impl std::fmt::Debug for Effects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effects")
            .field("queue", &self.queue)
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

fn check_key(what: &str, key: &str) -> Result<(), EffectError> {
    if key.is_empty() || key.len() > MAX_KEY {
        return Err(EffectError::Invalid(format!(
            "{what} must be 1 to {MAX_KEY} bytes, got {}",
            key.len()
        )));
    }
    if crate::job::has_control(key) {
        return Err(EffectError::Invalid(format!(
            "{what} must not contain control characters (such as NUL, newline or ESC)"
        )));
    }
    Ok(())
}

fn check_value(what: &str, len: usize) -> Result<(), EffectError> {
    if len > MAX_VALUE {
        return Err(EffectError::Invalid(format!(
            "{what} is {len} bytes, more than the {MAX_VALUE} allowed"
        )));
    }
    Ok(())
}

impl Effects {
    pub fn new(store: Arc<dyn Store>, scope: Arc<Scope>, lease: LeaseRef) -> Effects {
        Effects {
            store,
            queue: scope.queue.clone(),
            namespace: scope.namespace.clone(),
            grants: scope.grants.clone(),
            on_uncertain: scope.on_uncertain,
            scope,
            lease,
            dead: OnceLock::new(),
            refusals: std::sync::atomic::AtomicU32::new(0),
            watch: None,
        }
    }

    /// The same effects, with `watch` seeing every step and outcome (`khata
    /// verify`). See [`recorded`].
    pub fn watched(mut self, watch: Arc<dyn Watch>) -> Effects {
        self.watch = Some(watch);
        self
    }

    /// Shows a step to the watch, if any. When it asks to stop there, the
    /// call never returns: the watch's owner drops the attempt.
    async fn step(&self, kind: &str, key: &str, fingerprint: &[u8], point: Point) {
        let Some(watch) = &self.watch else {
            return;
        };
        let step = Step {
            kind,
            key,
            fingerprint,
            point,
        };
        if watch.stop_at(&step) {
            std::future::pending::<()>().await;
        }
    }

    /// Runs an embedded write between the watch's `before started` and
    /// `done` steps; unwatched it is just `write`.
    async fn embedded<T>(
        &self,
        kind: &str,
        key: &str,
        request: &[u8],
        write: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, EffectError> {
        let Some(watch) = &self.watch else {
            return Ok(write.await?);
        };
        let fingerprint = fenced::fingerprint(kind, request);
        self.step(kind, key, &fingerprint, Point::BeforeStarted)
            .await;
        let result = write.await.map_err(EffectError::from);
        let outcome = match &result {
            Ok(_) => "applied".to_owned(),
            Err(e) => format!("refused:{}", e.reason()),
        };
        watch.outcome(kind, key, &outcome);
        let result = result?;
        self.step(kind, key, &fingerprint, Point::Done).await;
        Ok(result)
    }

    /// Why an effect of this attempt asked for its job to be dead-lettered,
    /// if one did (see the `dead` field).
    pub fn dead_letter(&self) -> Option<&str> {
        self.dead.get().map(String::as_str)
    }

    /// Records an external effect on the attempt (`performed`, `replayed`,
    /// `refused:<reason>`, ...) and counts it.
    async fn record(&self, kind: &str, key: &str, outcome: &str) {
        if let Some(watch) = &self.watch {
            watch.outcome(kind, key, outcome);
        }
        metrics::counter!("khata_effects_total", "kind" => kind.to_owned(), "outcome" => outcome.to_owned())
            .increment(1);
        let record = EffectRecord {
            attempt: self.lease.attempt,
            kind: kind.to_owned(),
            key: key.to_owned(),
            outcome: outcome.to_owned(),
            at: self.now(),
        };
        if let Err(e) = self.store.record_effect(&self.lease.job_id, record).await {
            tracing::warn!(error = %e, "could not record an effect on its attempt");
        }
    }

    /// Records a refusal and hands the error back. At most
    /// [`MAX_REFUSALS_RECORDED`] refusals of one attempt are recorded, each
    /// key cut to [`MAX_KEY`] bytes: a guest that calls in a loop with a bad
    /// key cannot fill the ledger. The one after them records how many are
    /// not (`refusals` / `not-recorded`); every refusal is counted in
    /// `khata_effects_total`.
    async fn refused(&self, kind: &str, key: &str, e: EffectError) -> EffectError {
        let n = self
            .refusals
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            + 1;
        let outcome = format!("refused:{}", e.reason());
        if n <= MAX_REFUSALS_RECORDED {
            let cut = &key[..key.floor_char_boundary(MAX_KEY)];
            self.record(kind, cut, &outcome).await;
        } else {
            metrics::counter!("khata_effects_total", "kind" => kind.to_owned(), "outcome" => outcome)
                .increment(1);
            if n == MAX_REFUSALS_RECORDED + 1 {
                self.record(
                    "refusals",
                    &format!("past-{MAX_REFUSALS_RECORDED}"),
                    "not-recorded",
                )
                .await;
            }
        }
        e
    }

    /// Asks for the job to be dead-lettered; the first reason given stays.
    fn ask_dead_letter(&self, reason: String) {
        let _ = self.dead.set(reason);
    }

    /// Now, on the daemon's clock.
    fn now(&self) -> Millis {
        self.scope.clock.now()
    }

    pub fn lease(&self) -> &LeaseRef {
        &self.lease
    }

    fn kv_granted(&self) -> Result<(), EffectError> {
        if self.grants.allows_kv() {
            Ok(())
        } else {
            Err(EffectError::Denied(format!(
                "queue {:?} is not granted kv (grants = {{ kv = true }})",
                self.queue
            )))
        }
    }

    fn index_granted(&self, collection: &str) -> Result<(), EffectError> {
        if self.grants.allows_index(collection) {
            Ok(())
        } else {
            Err(EffectError::Denied(format!(
                "queue {:?} is not granted index collection {collection:?} (grants = {{ index = [{collection:?}] }})",
                self.queue
            )))
        }
    }

    pub async fn kv_get(&self, key: &str) -> Result<Option<Vec<u8>>, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        Ok(self.store.kv_get(&self.lease, &self.namespace, key).await?)
    }

    pub async fn kv_put(&self, key: &str, value: Vec<u8>) -> Result<(), EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        check_value("a kv value", value.len())?;
        let request = [key.as_bytes(), &[0], &value].concat();
        self.embedded(
            "kv",
            key,
            &request,
            self.store.kv_put(
                &self.lease,
                KvPut {
                    ns: self.namespace.clone(),
                    key: key.to_owned(),
                    value,
                    mode: PutMode::Replace,
                },
                self.now(),
            ),
        )
        .await
        .map(drop)
    }

    pub async fn kv_insert_if_absent(
        &self,
        key: &str,
        value: Vec<u8>,
    ) -> Result<bool, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        check_value("a kv value", value.len())?;
        let request = [b"insert-if-absent\0", key.as_bytes(), &[0], &value].concat();
        self.embedded(
            "kv",
            key,
            &request,
            self.store.kv_put(
                &self.lease,
                KvPut {
                    ns: self.namespace.clone(),
                    key: key.to_owned(),
                    value,
                    mode: PutMode::IfAbsent,
                },
                self.now(),
            ),
        )
        .await
    }

    pub async fn kv_delete(&self, key: &str) -> Result<bool, EffectError> {
        self.kv_granted()?;
        check_key("a kv key", key)?;
        let request = [b"delete\0", key.as_bytes()].concat();
        self.embedded(
            "kv",
            key,
            &request,
            self.store.kv_delete(&self.lease, &self.namespace, key),
        )
        .await
    }

    pub async fn index_upsert(
        &self,
        collection: &str,
        id: &str,
        document: &str,
        version: u64,
    ) -> Result<UpsertOutcome, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        check_value("a document", document.len())?;
        let key = format!("{collection}/{id}");
        let request = format!("{key}\0{version}\0{document}");
        self.embedded(
            "index",
            &key,
            request.as_bytes(),
            self.store.index_upsert(
                &self.lease,
                Doc {
                    collection: collection.to_owned(),
                    id: id.to_owned(),
                    version,
                    document: document.to_owned(),
                },
                self.now(),
            ),
        )
        .await
    }

    pub async fn index_remove(
        &self,
        collection: &str,
        id: &str,
        version: u64,
    ) -> Result<bool, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        let key = format!("{collection}/{id}");
        let request = format!("remove\0{key}\0{version}");
        self.embedded(
            "index",
            &key,
            request.as_bytes(),
            self.store.index_remove(
                &self.lease,
                Tombstone {
                    collection: collection.to_owned(),
                    id: id.to_owned(),
                    version,
                },
                self.now(),
            ),
        )
        .await
    }

    pub async fn index_get(
        &self,
        collection: &str,
        id: &str,
    ) -> Result<Option<String>, EffectError> {
        self.index_granted(collection)?;
        check_key("a document id", id)?;
        Ok(self
            .store
            .index_get_leased(
                &self.lease,
                &DocId {
                    collection: collection.to_owned(),
                    id: id.to_owned(),
                },
            )
            .await?)
    }

    /// Sends one email through the configured transport, once per key.
    /// Returns the Message-ID and whether the send was replayed.
    pub async fn email_send(&self, key: &str, mail: Mail) -> Result<(String, bool), EffectError> {
        let mailer = match self.email_checks(key, &mail) {
            Ok(m) => m,
            Err(e) => return Err(self.refused("email", key, e).await),
        };
        let from = mail.from.as_deref().unwrap_or(&self.scope.email_from);
        let message_id = email::message_id(&self.namespace, key, from);
        let effect = EmailEffect {
            mailer,
            key,
            mail: &mail,
            message_id: &message_id,
        };
        let answer = Fenced::new(self, &effect, key).call().await?;
        Ok((message_id, answer.replayed))
    }

    /// The transport to send through.
    fn email_checks(&self, key: &str, mail: &Mail) -> Result<&dyn MailTransport, EffectError> {
        if !self.grants.allows_email() {
            return Err(EffectError::Denied(format!(
                "queue {:?} is not granted email (grants = {{ email = true }})",
                self.queue
            )));
        }
        check_key("an email key", key)?;
        let recipients = mail.to.len() + mail.cc.len();
        if recipients > MAX_RECIPIENTS {
            return Err(EffectError::Invalid(format!(
                "a message has {recipients} recipients (to and cc); at most {MAX_RECIPIENTS} are sent"
            )));
        }
        if mail.subject.len() > MAX_SUBJECT {
            return Err(EffectError::Invalid(format!(
                "the subject is {} bytes; at most {MAX_SUBJECT} (RFC 5322's line length)",
                mail.subject.len()
            )));
        }
        let mailer = self.scope.mailer.as_deref().map_err(|e| {
            EffectError::Transient(format!("the email transport is not available: {e}"))
        })?;
        if let Some(from) = &mail.from
            && !mailer.allows_sender(from)
        {
            return Err(EffectError::Denied(format!(
                "From {from:?} is not one of the senders [email] allows (email.from and email.senders)"
            )));
        }
        Ok(mailer)
    }

    /// Sends one request to a named provider, once per key.
    pub async fn http_send(
        &self,
        key: &str,
        provider_name: &str,
        request: HttpRequest,
    ) -> Result<(HttpResponse, bool), EffectError> {
        if let Err(e) = self.http_checks(key, provider_name, &request) {
            return Err(self.refused("http", key, e).await);
        }
        let effect = HttpEffect {
            transport: &*self.scope.providers,
            provider: provider_name,
            key,
            request: &request,
        };
        let answer = Fenced::new(self, &effect, key).call().await?;
        let response = if answer.result == RESOLVED_BY_OPERATOR {
            HttpResponse {
                status: 204,
                headers: vec![("khata-resolved-by".into(), "operator".into())],
                body: Vec::new(),
            }
        } else {
            serde_json::from_slice(&answer.result).map_err(|e| {
                EffectError::Transient(format!(
                    "the recorded response of {key:?} cannot be read: {e}"
                ))
            })?
        };
        Ok((response, answer.replayed))
    }
}

/// The canonical form of an HTTP effect: the provider's name, then the
/// request as [`http::canonical`] writes it.
fn http_canonical(provider: &str, request: &HttpRequest) -> Vec<u8> {
    let mut c = provider.as_bytes().to_vec();
    c.push(0);
    c.extend(http::canonical(provider, request));
    c
}

impl Effects {
    fn http_checks(
        &self,
        key: &str,
        provider: &str,
        request: &HttpRequest,
    ) -> Result<(), EffectError> {
        if !self.grants.allows_http(provider) {
            return Err(EffectError::Denied(format!(
                "queue {:?} is not granted http provider {provider:?} (grants = {{ http = [{provider:?}] }})",
                self.queue
            )));
        }
        check_key("an http key", key)?;
        self.scope.providers.check(provider, request)
    }
}

struct EmailEffect<'a> {
    mailer: &'a dyn MailTransport,
    key: &'a str,
    mail: &'a Mail,
    message_id: &'a str,
}

impl Effect for EmailEffect<'_> {
    fn kind(&self) -> &'static str {
        "email"
    }

    fn canonical(&self) -> Vec<u8> {
        serde_json::to_vec(self.mail).unwrap_or_default()
    }

    fn idempotent(&self) -> bool {
        self.mailer.idempotent()
    }

    async fn perform(&self, _fencing_token: u64) -> Tried {
        match self.mailer.send(self.key, self.mail, self.message_id).await {
            Ok(()) => Tried::Done(self.message_id.as_bytes().to_vec()),
            Err(SendError::Invalid(m)) => Tried::Invalid(m),
            Err(SendError::NotSent(m)) => Tried::NotSent(m),
            Err(SendError::Rejected(m)) => Tried::Rejected(m),
            Err(SendError::Unknown(m)) => Tried::Unknown(m),
        }
    }

    async fn reconcile(&self, _fencing_token: u64) -> Reconciled {
        match self.mailer.lookup(self.key, self.message_id).await {
            Some(true) => Reconciled::Happened(self.message_id.as_bytes().to_vec()),
            Some(false) => Reconciled::NotHappened,
            None => Reconciled::Unknown,
        }
    }
}

struct HttpEffect<'a> {
    transport: &'a dyn HttpTransport,
    provider: &'a str,
    key: &'a str,
    request: &'a HttpRequest,
}

fn recorded(response: &HttpResponse) -> Tried {
    match serde_json::to_vec(response) {
        Ok(bytes) => Tried::Done(bytes),
        Err(e) => Tried::Unknown(format!("the response could not be recorded: {e}")),
    }
}

impl Effect for HttpEffect<'_> {
    fn kind(&self) -> &'static str {
        "http"
    }

    fn canonical(&self) -> Vec<u8> {
        http_canonical(self.provider, self.request)
    }

    fn idempotent(&self) -> bool {
        self.transport.idempotent(self.provider)
    }

    async fn perform(&self, fencing_token: u64) -> Tried {
        match self
            .transport
            .send(self.provider, self.key, fencing_token, self.request)
            .await
        {
            Ok(response) => recorded(&response),
            Err(HttpError::Invalid(m)) => Tried::Invalid(m),
            Err(HttpError::NotSent(m)) => Tried::NotSent(m),
            // A response came, but too big to keep: the effect happened.
            Err(HttpError::TooLarge(m)) => recorded(&HttpResponse {
                status: 502,
                headers: vec![("khata-error".into(), format!("response too large: {m}"))],
                body: Vec::new(),
            }),
            Err(HttpError::Unknown(m)) => Tried::Unknown(m),
        }
    }

    async fn reconcile(&self, fencing_token: u64) -> Reconciled {
        match self
            .transport
            .reconcile(self.provider, self.key, fencing_token)
            .await
        {
            Some(Ok(Some(response))) => match serde_json::to_vec(&response) {
                Ok(bytes) => Reconciled::Happened(bytes),
                Err(_) => Reconciled::Unknown,
            },
            Some(Ok(None)) => Reconciled::NotHappened,
            Some(Err(_)) | None => Reconciled::Unknown,
        }
    }
}
