//! The HTTP API (docs/api.md): JSON routes over the store and the queues.
//!
//! Every route but `/healthz`, `/readyz` and the dashboard's static files
//! (`dashboard`) needs the bearer token when one is configured.
//! Errors are `{"error": {"code", "message"}}`; a refused request changes
//! nothing. An enqueue is answered only once the job is durable.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Value, json};
use tower_http::catch_panic::CatchPanicLayer;

use crate::job::{
    Attempt, Enqueued, Job, JobState, MAX_ATTEMPTS, Millis, NewJob, SCHEDULE_ID_PREFIX, has_control,
};
use crate::queue::Queues;
use crate::schedule::Schedules;
use crate::store::{
    DocId, Fence, FenceFilter, FenceId, FenceState, JobFilter, Resolution, Store, StoreError,
};

pub mod dashboard;
pub mod guard;
pub mod serve;

/// Most jobs in one batch enqueue.
pub const MAX_BATCH: usize = 1000;

/// What the routes share.
#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    pub queues: Arc<Queues>,
    pub schedules: Arc<Schedules>,
    /// The SHA-256 of the API token: requests are compared by digest, so
    /// the comparison's time tells nothing of the token's length or bytes.
    pub token: Option<TokenDigest>,
    pub allowed_hosts: guard::AllowedHosts,
    /// The body limit of a batch enqueue (`[daemon] max_request`).
    pub max_request: u64,
    pub metrics: Option<PrometheusHandle>,
}

/// The SHA-256 of an API token. Its `Debug` prints nothing of it.
#[derive(Clone)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    pub fn of(token: &str) -> TokenDigest {
        use sha2::{Digest, Sha256};
        TokenDigest(Sha256::digest(token.as_bytes()).into())
    }

    /// Whether `given` is the token: both digests are compared in full.
    fn matches(&self, given: &str) -> bool {
        let given = TokenDigest::of(given);
        self.0
            .iter()
            .zip(given.0.iter())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
    }
}

impl std::fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenDigest(<redacted>)")
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

/// An error answer: a status, a stable code and a message naming what is wrong.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    code: &'static str,
    message: String,
}

impl ApiError {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }

    fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"code": self.code, "message": self.message}});
        (self.status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        match &e {
            StoreError::IdReused { .. } => {
                ApiError::new(StatusCode::CONFLICT, "id_reused", e.to_string())
            }
            StoreError::NotFound(_) => {
                ApiError::new(StatusCode::NOT_FOUND, "not_found", e.to_string())
            }
            StoreError::InvalidState { .. } => {
                ApiError::new(StatusCode::CONFLICT, "invalid_state", e.to_string())
            }
            StoreError::InvalidFence { .. } => {
                ApiError::new(StatusCode::CONFLICT, "invalid_fence", e.to_string())
            }
            StoreError::Fenced { .. } => {
                ApiError::new(StatusCode::CONFLICT, "fenced", e.to_string())
            }
            StoreError::Unavailable(_) => ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "storage_unavailable",
                e.to_string(),
            ),
        }
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// The router with every route, auth and limits.
pub fn router(state: AppState) -> Router {
    let api = Router::new();
    #[cfg(feature = "failpoints")]
    let api = api.route("/v1/test/clock", post(advance_clock));
    let api = api
        .route("/v1/queues", get(list_queues))
        .route("/v1/schedules", get(list_schedules))
        .route("/v1/queues/{queue}/jobs", post(enqueue))
        .route("/v1/queues/{queue}/jobs/batch", post(enqueue_batch))
        .route("/v1/jobs", get(list_jobs))
        .route("/v1/jobs/{id}", get(get_job).delete(cancel_job))
        .route("/v1/jobs/{id}/retry", post(retry_job))
        .route("/v1/index/{collection}/{id}", get(get_document))
        .route("/v1/fences", get(list_fences))
        .route("/v1/fences/resolve", post(resolve_fence))
        .route("/metrics", get(render_metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth));
    Router::new()
        .route("/healthz", get(|| async { Json(json!({"status": "ok"})) }))
        .route("/readyz", get(ready))
        .merge(dashboard::routes())
        .merge(api)
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such route") })
        // Each route that takes a body reads it with a limit of its own
        // (`read_body`).
        .layer(DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(
            state.allowed_hosts.clone(),
            guard::check,
        ))
        .layer(middleware::from_fn(json_errors))
        .layer(CatchPanicLayer::custom(panicked))
        .with_state(state)
}

/// Every error answer carries the JSON error body, also those the routes
/// do not make themselves (axum's rejections of a path it cannot decode, a
/// method a route does not take): their text becomes the message.
async fn json_errors(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    let status = response.status();
    let json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|t| t.starts_with("application/json"));
    if status.as_u16() < 400 || json {
        return response;
    }
    let text = axum::body::to_bytes(response.into_body(), 64 << 10)
        .await
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&text).trim().to_owned();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let code = match status {
        StatusCode::BAD_REQUEST => "invalid_request",
        StatusCode::NOT_FOUND => "not_found",
        StatusCode::METHOD_NOT_ALLOWED => "method_not_allowed",
        StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
        StatusCode::UNSUPPORTED_MEDIA_TYPE => "unsupported_media_type",
        StatusCode::REQUEST_TIMEOUT => "request_timeout",
        _ if status.is_server_error() => "internal",
        _ => "invalid_request",
    };
    ApiError::new(status, code, message).into_response()
}

/// A route that panicked: a 500 with the JSON error body, a log line and a
/// count (`khata_api_panics_total`), never a closed connection. Nothing
/// was half-changed: the store answers a request whole or not at all.
fn panicked(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("a panic without a message");
    tracing::error!(panic = what, "an API route panicked; answered 500");
    metrics::counter!("khata_api_panics_total").increment(1);
    ApiError::new(
        StatusCode::INTERNAL_SERVER_ERROR,
        "internal",
        "the daemon failed to answer this request; the error is in its log",
    )
    .into_response()
}

async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if let Some(token) = &state.token {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer);
        if !given.is_some_and(|g| token.matches(g)) {
            let message = if given.is_some() {
                "the bearer token is wrong"
            } else {
                "this daemon needs `Authorization: Bearer <token>`"
            };
            return ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", message)
                .into_response();
        }
    }
    next.run(req).await
}

/// The credentials of an `Authorization` value in the `Bearer` scheme,
/// whose name is matched without regard to case (RFC 9110 11.1).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, credentials) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| credentials.trim_start())
}

/// The body of one enqueue. The payload is kept as the JSON text that was
/// sent (`RawValue`): its size is checked without building a tree, and what
/// the handler and every answer see is exactly that text (big numbers
/// included).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnqueueBody {
    pub payload: Box<RawValue>,
    #[serde(default)]
    pub id: Option<String>,
    #[serde(default)]
    pub dedup_key: Option<String>,
    #[serde(default)]
    pub dedup_for: Option<String>,
    #[serde(default)]
    pub delay: Option<String>,
    #[serde(default)]
    pub run_at: Option<String>,
    #[serde(default)]
    pub priority: Option<i32>,
    #[serde(default)]
    pub max_attempts: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchBody {
    jobs: Vec<EnqueueBody>,
}

fn parse_body<'de, T: Deserialize<'de>>(bytes: &'de [u8]) -> ApiResult<T> {
    serde_json::from_slice(bytes).map_err(|e| ApiError::bad_request(format!("request body: {e}")))
}

/// What an enqueue's body may hold beside its payload (id, keys, times).
pub const ENVELOPE: u64 = 64 << 10;
/// The body limit of routes that take no payload.
const SMALL_BODY: u64 = 64 << 10;

/// Reads a request body of at most `limit` bytes. A `Content-Length` past
/// the limit is refused before anything is read, and a body without one as
/// soon as the read passes it: 413 `request_too_large`, naming `what`
/// bounds it, with nothing buffered beyond the limit.
async fn read_body(
    headers: &HeaderMap,
    body: axum::body::Body,
    limit: u64,
    what: &str,
) -> ApiResult<Bytes> {
    let too_large = |size: Option<u64>| {
        let size = size.map_or_else(|| "larger".to_owned(), |n| format!("{n} bytes"));
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request_too_large",
            format!("the request body is {size}; at most {limit} bytes are taken here ({what})"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit) {
        return Err(too_large(declared));
    }
    let limit_usize = usize::try_from(limit).unwrap_or(usize::MAX);
    axum::body::to_bytes(body, limit_usize).await.map_err(|e| {
        // A length error is the only one `to_bytes` makes itself; any other
        // is the connection's (a client that went away).
        if std::error::Error::source(&e).is_some_and(|s| s.is::<http_body_util::LengthLimitError>())
        {
            too_large(None)
        } else {
            ApiError::bad_request(format!("request body: {e}"))
        }
    })
}

fn parse_duration(field: &str, s: &str) -> ApiResult<Duration> {
    humantime::parse_duration(s)
        .map_err(|e| ApiError::bad_request(format!("{field}: invalid duration {s:?}: {e}")))
}

#[cfg(feature = "failpoints")]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AdvanceBody {
    advance: String,
}

/// Test builds only: moves the daemon's clock forward, e.g. past a backoff.
#[cfg(feature = "failpoints")]
async fn advance_clock(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Json<Value>> {
    let body = read_body(&headers, body, SMALL_BODY, "a clock move").await?;
    let body: AdvanceBody = parse_body(&body)?;
    let by = parse_duration("advance", &body.advance)?;
    state.queues.advance_clock(by);
    Ok(Json(json!({"now": state.queues.now().rfc3339()})))
}

/// Checks one enqueue body against its queue and turns it into a `NewJob`.
fn new_job(
    state: &AppState,
    queue: &str,
    body: EnqueueBody,
    field: &str,
    now: Millis,
) -> ApiResult<NewJob> {
    let q = state.queues.get(queue).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_queue",
            format!("no queue named {queue:?} in jobs.toml"),
        )
    })?;
    let cfg = q.config();
    let payload = String::from(Box::<str>::from(body.payload));
    if payload.len() as u64 > cfg.max_payload {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "payload_too_large",
            format!(
                "{field}payload is {} bytes; queue {queue:?} takes at most {} (max_payload)",
                payload.len(),
                cfg.max_payload
            ),
        ));
    }
    let check_name = |name: &str, v: &Option<String>| -> ApiResult<()> {
        match v {
            Some(s) if s.is_empty() || s.len() > 512 => Err(ApiError::bad_request(format!(
                "{field}{name} must be 1 to 512 bytes"
            ))),
            // Ids and keys reach logs and terminals, and PostgreSQL's text
            // cannot hold NUL: every backend takes the same ids.
            Some(s) if has_control(s) => Err(ApiError::bad_request(format!(
                "{field}{name} must not contain control characters (such as NUL, newline or ESC)"
            ))),
            _ => Ok(()),
        }
    };
    check_name("id", &body.id)?;
    check_name("dedup_key", &body.dedup_key)?;
    if let Some(id) = &body.id
        && id.starts_with(SCHEDULE_ID_PREFIX)
    {
        return Err(ApiError::bad_request(format!(
            "{field}id: ids starting with {SCHEDULE_ID_PREFIX:?} are the schedules' own"
        )));
    }
    let run_at = match (&body.delay, &body.run_at) {
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_request(format!(
                "{field}delay and run_at: give one, not both"
            )));
        }
        (Some(d), None) => now.plus(parse_duration(&format!("{field}delay"), d)?),
        (None, Some(t)) => Millis::parse_rfc3339(t).ok_or_else(|| {
            ApiError::bad_request(format!("{field}run_at: not an RFC 3339 time: {t:?}"))
        })?,
        (None, None) => now,
    };
    if run_at > Millis::LATEST {
        let what = if body.delay.is_some() {
            "delay"
        } else {
            "run_at"
        };
        return Err(ApiError::bad_request(format!(
            "{field}{what}: the job would be due after {}, the latest time allowed",
            Millis::LATEST.rfc3339()
        )));
    }
    let dedup_for = body
        .dedup_for
        .as_deref()
        .map(|d| parse_duration(&format!("{field}dedup_for"), d))
        .transpose()?;
    if dedup_for.is_some() && body.dedup_key.is_none() {
        return Err(ApiError::bad_request(format!(
            "{field}dedup_for needs a dedup_key"
        )));
    }
    let max_attempts = body.max_attempts.unwrap_or(cfg.max_attempts);
    if !(1..=MAX_ATTEMPTS).contains(&max_attempts) {
        return Err(ApiError::bad_request(format!(
            "{field}max_attempts must be 1 to {MAX_ATTEMPTS}, got {max_attempts}"
        )));
    }
    Ok(NewJob {
        queue: queue.to_owned(),
        id: body.id,
        payload,
        priority: body.priority.unwrap_or(0),
        run_at,
        max_attempts,
        dedup_key: body.dedup_key,
        dedup_for,
    })
}

/// One result of an enqueue (docs/api.md#enqueue).
#[derive(Serialize)]
struct EnqueuedView<'a> {
    job: JobView<'a>,
    deduplicated: bool,
}

fn enqueued_view(e: &Enqueued) -> EnqueuedView<'_> {
    EnqueuedView {
        job: JobView::new(&e.job),
        deduplicated: e.deduplicated,
    }
}

/// The queue named in a path, or 404 `unknown_queue`.
fn known_queue(state: &AppState, queue: &str) -> ApiResult<Arc<crate::queue::QueueRuntime>> {
    state.queues.get(queue).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "unknown_queue",
            format!("no queue named {queue:?} in jobs.toml"),
        )
    })
}

async fn enqueue(
    State(state): State<AppState>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    let limit = known_queue(&state, &queue)?
        .config()
        .max_payload
        .saturating_add(ENVELOPE);
    let body = read_body(&headers, body, limit, "the queue's max_payload and 64 KiB").await?;
    let body: EnqueueBody = parse_body(&body)?;
    let now = state.queues.now();
    let job = new_job(&state, &queue, body, "", now)?;
    let mut results = state.queues.enqueue(&queue, vec![job], now).await?;
    let result = results.remove(0);
    let status = if result.deduplicated {
        StatusCode::OK
    } else {
        StatusCode::CREATED
    };
    Ok((status, Json(enqueued_view(&result))).into_response())
}

async fn enqueue_batch(
    State(state): State<AppState>,
    Path(queue): Path<String>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Response> {
    known_queue(&state, &queue)?;
    let body = read_body(&headers, body, state.max_request, "[daemon] max_request").await?;
    let body: BatchBody = parse_body(&body)?;
    if body.jobs.is_empty() || body.jobs.len() > MAX_BATCH {
        return Err(ApiError::bad_request(format!(
            "jobs: a batch holds 1 to {MAX_BATCH} jobs, got {}",
            body.jobs.len()
        )));
    }
    let now = state.queues.now();
    let jobs = body
        .jobs
        .into_iter()
        .enumerate()
        .map(|(i, b)| new_job(&state, &queue, b, &format!("jobs[{i}]."), now))
        .collect::<ApiResult<Vec<_>>>()?;
    let results = state.queues.enqueue(&queue, jobs, now).await.map_err(|e| match e {
        StoreError::IdReused { ref id, index } => ApiError::new(
            StatusCode::CONFLICT,
            "id_reused",
            format!("jobs[{index}].id: job id {id:?} is already used by a job with another payload or queue; nothing was enqueued"),
        ),
        other => other.into(),
    })?;
    #[derive(Serialize)]
    struct Results<'a> {
        results: Vec<EnqueuedView<'a>>,
    }
    Ok(Json(Results {
        results: results.iter().map(enqueued_view).collect(),
    })
    .into_response())
}

fn time(t: Millis) -> Value {
    Value::String(t.rfc3339())
}

fn attempt_json(a: &Attempt) -> Value {
    json!({
        "number": a.number,
        "fencing_token": a.fencing_token,
        "started_at": time(a.started_at),
        "ended_at": a.ended_at.map(time),
        "outcome": a.outcome,
        "error": a.error,
        "plugin_version": a.plugin_version,
    })
}

/// Stored JSON text as it is, borrowed, not copied or parsed into a tree
/// (it is only scanned to check that it is JSON); text that is not JSON (it
/// cannot be, but the ledger is not trusted blindly) as a string.
enum StoredJson<'a> {
    Json(&'a RawValue),
    Text(&'a str),
}

impl<'a> StoredJson<'a> {
    fn new(s: &'a str) -> StoredJson<'a> {
        match serde_json::from_str::<&RawValue>(s) {
            Ok(raw) => StoredJson::Json(raw),
            Err(_) => StoredJson::Text(s),
        }
    }
}

impl Serialize for StoredJson<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            StoredJson::Json(raw) => raw.serialize(s),
            StoredJson::Text(text) => text.serialize(s),
        }
    }
}

/// The job object (docs/api.md#the-job-object).
#[derive(Serialize)]
pub struct JobView<'a> {
    id: &'a str,
    queue: &'a str,
    state: JobState,
    payload: StoredJson<'a>,
    priority: i32,
    attempt: u32,
    max_attempts: u32,
    dedup_key: Option<&'a str>,
    run_at: String,
    enqueued_at: String,
    finished_at: Option<String>,
    result: Option<StoredJson<'a>>,
    last_error: Option<&'a str>,
    attempts: Vec<Value>,
    effects: Vec<Value>,
}

impl<'a> JobView<'a> {
    pub fn new(j: &'a Job) -> JobView<'a> {
        JobView {
            id: &j.id,
            queue: &j.queue,
            state: j.state,
            payload: StoredJson::new(&j.payload),
            priority: j.priority,
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            dedup_key: j.dedup_key.as_deref(),
            run_at: j.run_at.rfc3339(),
            enqueued_at: j.enqueued_at.rfc3339(),
            finished_at: j.finished_at.map(Millis::rfc3339),
            result: j.result.as_deref().map(StoredJson::new),
            last_error: j.last_error.as_deref(),
            attempts: j.attempts.iter().map(attempt_json).collect(),
            effects: Vec::new(),
        }
    }
}

async fn list_schedules(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"schedules": state.schedules.views(state.queues.now())}))
}

/// How long `/readyz` waits for the store before calling it unavailable.
const READY_WAIT: Duration = Duration::from_secs(2);

/// Readiness, beside `/healthz`'s liveness: 200 `{"status": "ready"}` when
/// the store answers a read within [`READY_WAIT`], else 503
/// `storage_unavailable`, so that a load balancer sends enqueues to a
/// daemon that can take them. Needs no token, as `/healthz`.
async fn ready(State(state): State<AppState>) -> ApiResult<Json<Value>> {
    if let Some(why) = state.store.halted() {
        return Err(
            StoreError::Unavailable(format!("the ledger stopped taking writes: {why}")).into(),
        );
    }
    // A read of an id no job can have (ids are not empty): one indexed look-up.
    match tokio::time::timeout(READY_WAIT, state.store.job("", state.queues.now())).await {
        Ok(Ok(_)) => Ok(Json(json!({"status": "ready"}))),
        Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string()).into()),
        Err(_) => Err(StoreError::Unavailable(format!(
            "the store did not answer within {}",
            humantime::format_duration(READY_WAIT)
        ))
        .into()),
    }
}

async fn get_job(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    // Armed by the panic test: a panic in a route is a 500, not a closed
    // connection.
    let _ = crate::failpoints::armed("api::get_job");
    let job = state
        .store
        .job(&id, state.queues.now())
        .await?
        .ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, "not_found", format!("no job {id:?}"))
        })?;
    let effects = state.store.effects(&id).await?;
    let mut body = JobView::new(&job);
    body.effects = effects
        .iter()
        .map(|e| json!({"attempt": e.attempt, "kind": e.kind, "key": e.key, "outcome": e.outcome, "at": time(e.at)}))
        .collect();
    Ok(Json(body).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FenceQuery {
    namespace: Option<String>,
    state: Option<String>,
    limit: Option<u32>,
}

fn fence_json(f: &Fence) -> Value {
    json!({
        "namespace": f.id.namespace,
        "kind": f.id.kind,
        "key": f.id.key,
        "state": f.state,
        "job_id": f.job_id,
        "attempt": f.attempt,
        "fencing_token": f.token,
        "created_at": time(f.created_at),
        "updated_at": time(f.updated_at),
    })
}

async fn list_fences(
    State(state): State<AppState>,
    query: Result<Query<FenceQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Json<Value>> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {}", e.body_text())))?;
    let fence_state = q
        .state
        .as_deref()
        .map(|s| {
            FenceState::parse(s).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "state: unknown fence state {s:?}: expected started, done or uncertain"
                ))
            })
        })
        .transpose()?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit: must be 1 to 1000"));
    }
    let fences = state
        .store
        .fences(&FenceFilter {
            namespace: q.namespace,
            state: fence_state,
            limit,
        })
        .await?;
    Ok(Json(
        json!({"fences": fences.iter().map(fence_json).collect::<Vec<_>>()}),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    namespace: String,
    kind: String,
    key: String,
    outcome: String,
}

async fn resolve_fence(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> ApiResult<Json<Value>> {
    let body = read_body(&headers, body, SMALL_BODY, "a fence resolution").await?;
    let body: ResolveBody = parse_body(&body)?;
    let resolution = Resolution::parse(&body.outcome).ok_or_else(|| {
        ApiError::bad_request(format!(
            "outcome: {:?} is neither \"done\" nor \"not-done\"",
            body.outcome
        ))
    })?;
    let id = FenceId {
        namespace: body.namespace,
        kind: body.kind,
        key: body.key,
    };
    state
        .store
        .fence_resolve(&id, resolution, state.queues.now())
        .await?;
    tracing::info!(namespace = %id.namespace, kind = %id.kind, key = %id.key, outcome = %body.outcome, "fence resolved by an operator");
    Ok(Json(
        json!({"namespace": id.namespace, "kind": id.kind, "key": id.key, "resolved": body.outcome}),
    ))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    queue: Option<String>,
    state: Option<String>,
    limit: Option<u32>,
    cursor: Option<String>,
}

async fn list_jobs(
    State(state): State<AppState>,
    query: Result<Query<ListQuery>, axum::extract::rejection::QueryRejection>,
) -> ApiResult<Response> {
    let Query(q) = query.map_err(|e| ApiError::bad_request(format!("query: {}", e.body_text())))?;
    let job_state = q
        .state
        .as_deref()
        .map(|s| {
            s.parse::<JobState>()
                .map_err(|e| ApiError::bad_request(format!("state: {e}")))
        })
        .transpose()?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::bad_request("limit: must be 1 to 1000"));
    }
    if let Some(c) = &q.cursor
        && c.parse::<i64>().is_err()
    {
        return Err(ApiError::bad_request(format!(
            "cursor: not a cursor from this API: {c:?}"
        )));
    }
    let page = state
        .store
        .jobs(
            JobFilter {
                queue: q.queue,
                state: job_state,
                limit,
                cursor: q.cursor,
            },
            state.queues.now(),
        )
        .await?;
    // A typed answer: `json!` would parse every stored payload and result
    // into a tree again.
    #[derive(Serialize)]
    struct Page<'a> {
        jobs: Vec<JobView<'a>>,
        next_cursor: Option<String>,
    }
    Ok(Json(Page {
        jobs: page.jobs.iter().map(JobView::new).collect(),
        next_cursor: page.next_cursor,
    })
    .into_response())
}

/// `{"job": ...}`, typed for the same reason as the listing.
#[derive(Serialize)]
struct OneJob<'a> {
    job: JobView<'a>,
}

async fn retry_job(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let job = state.store.retry(&id, state.queues.now()).await?;
    state.queues.wake(&job.queue);
    Ok(Json(OneJob {
        job: JobView::new(&job),
    })
    .into_response())
}

async fn cancel_job(State(state): State<AppState>, Path(id): Path<String>) -> ApiResult<Response> {
    let (job, was_active) = state.store.cancel(&id, state.queues.now()).await?;
    if was_active {
        state.queues.interrupt(&job.queue, &job.id).await;
    }
    Ok(Json(OneJob {
        job: JobView::new(&job),
    })
    .into_response())
}

async fn list_queues(State(state): State<AppState>) -> ApiResult<Json<Value>> {
    let counts: BTreeMap<String, _> = state
        .store
        .counts(state.queues.now())
        .await?
        .into_iter()
        .collect();
    let list: Vec<Value> = state
        .queues
        .list()
        .into_iter()
        .map(|q| {
            let slot = q.plugin();
            let config = q.config();
            json!({
                "name": config.name,
                "plugin": config.plugin,
                "namespace": config.namespace,
                "concurrency": config.concurrency,
                "version": slot.plugin.as_ref().map(|p| p.short_version().to_owned()),
                "sha256": slot.plugin.as_ref().map(|p| p.version.clone()),
                "loaded_at": slot.plugin.as_ref().map(|p| time(p.loaded_at)),
                "code": slot.plugin.as_ref().map(|p| p.code.as_str()),
                "load_error": slot.error,
                "counts": counts.get(&config.name).cloned().unwrap_or_default(),
            })
        })
        .collect();
    Ok(Json(json!({"queues": list})))
}

async fn get_document(
    State(state): State<AppState>,
    Path((collection, id)): Path<(String, String)>,
) -> ApiResult<Json<Value>> {
    let (doc, version) = state
        .store
        .index_get(&DocId {
            collection: collection.clone(),
            id: id.clone(),
        })
        .await?
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                "not_found",
                format!("no document {id:?} in collection {collection:?}"),
            )
        })?;
    let document = serde_json::from_str::<Value>(&doc).unwrap_or(Value::String(doc));
    Ok(Json(
        json!({"collection": collection, "id": id, "version": version, "document": document}),
    ))
}

async fn render_metrics(State(state): State<AppState>) -> ApiResult<Response> {
    let Some(handle) = &state.metrics else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "metrics are off",
        ));
    };
    let counts = state.store.counts(state.queues.now()).await?;
    for (queue, c) in counts {
        for s in JobState::ALL {
            metrics::gauge!("khata_queue_depth", "queue" => queue.clone(), "state" => s.as_str())
                .set(c.get(s) as f64);
        }
    }
    Ok((
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        handle.render(),
    )
        .into_response())
}
