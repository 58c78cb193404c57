//! Finding the daemon (flags, `KHATA_URL`, the `[daemon]` section of
//! `jobs.toml`) and the client of its HTTP API, with timeouts on every
//! request and the API's errors as sentences.

use super::*;

// ---------------------------------------------------------------------------
// Finding the daemon

/// Where the daemon's API is, and the token it wants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// Base URL, e.g. `http://127.0.0.1:7373`.
    pub url: String,
    /// Bearer token, if one is known.
    pub token: Option<String>,
}

/// The part of jobs.toml that the client reads; the rest is the daemon's.
#[derive(Debug, Default, Deserialize)]
pub(super) struct ConfigFile {
    #[serde(default)]
    pub(super) daemon: DaemonSection,
}

#[derive(Debug, Default, Deserialize)]
pub(super) struct DaemonSection {
    pub(super) listen: Option<String>,
    pub(super) token: Option<String>,
    pub(super) token_file: Option<PathBuf>,
}

/// Decides where the client commands find the daemon.
///
/// `url` (from `--url`/`KHATA_URL`) wins; the configuration file is then not
/// read and the token is `token` alone. Without `url`, the configuration
/// file (`config`, or `jobs.toml` when it exists) gives the URL from
/// `[daemon] listen` and the token from `[daemon] token` or `token_file`
/// (relative to the file's directory), unless `token` is given. Without
/// either, [`DEFAULT_URL`]. A `config` that was named but cannot be read is
/// an error; empty values count as absent.
pub fn resolve_endpoint(
    url: Option<&str>,
    token: Option<&str>,
    config: Option<&Path>,
) -> anyhow::Result<Endpoint> {
    let given_token = token.map(str::trim).filter(|t| !t.is_empty());
    if let Some(url) = url.map(str::trim).filter(|u| !u.is_empty()) {
        return Ok(Endpoint {
            url: url.to_owned(),
            token: given_token.map(str::to_owned),
        });
    }
    let (path, required) = match config {
        Some(path) => (path, true),
        None => (Path::new(DEFAULT_CONFIG), false),
    };
    let mut endpoint = if required || path.exists() {
        endpoint_from_config(path)?
    } else {
        Endpoint {
            url: DEFAULT_URL.to_owned(),
            token: None,
        }
    };
    if let Some(token) = given_token {
        endpoint.token = Some(token.to_owned());
    }
    Ok(endpoint)
}

/// Reads the daemon's URL and token from a configuration file.
pub(super) fn endpoint_from_config(path: &Path) -> anyhow::Result<Endpoint> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read configuration file {}", path.display()))?;
    let config: ConfigFile = toml::from_str(&text)
        .with_context(|| format!("invalid configuration file {}", path.display()))?;
    let DaemonSection {
        listen,
        token,
        token_file,
    } = config.daemon;
    let url = match listen.as_deref().map(str::trim).filter(|l| !l.is_empty()) {
        Some(listen) => url_from_listen(listen),
        None => DEFAULT_URL.to_owned(),
    };
    let token = match (token, token_file) {
        (Some(token), _) => Some(token.trim().to_owned()),
        (None, Some(file)) => {
            let file = match path.parent() {
                Some(dir) => dir.join(file),
                None => file,
            };
            let token = std::fs::read_to_string(&file).with_context(|| {
                format!(
                    "cannot read the token file {} named in {} (or pass --token / KHATA_TOKEN)",
                    file.display(),
                    path.display()
                )
            })?;
            Some(token.trim().to_owned())
        }
        (None, None) => None,
    };
    Ok(Endpoint {
        url,
        token: token.filter(|t| !t.is_empty()),
    })
}

/// The URL at which a client reaches a daemon listening on `listen`: a
/// wildcard address (`0.0.0.0`, `[::]`) is reached on loopback.
pub(super) fn url_from_listen(listen: &str) -> String {
    if listen.contains("://") {
        return listen.to_owned();
    }
    match listen.parse::<SocketAddr>() {
        Ok(mut addr) => {
            if addr.ip().is_unspecified() {
                addr.set_ip(match addr.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
                });
            }
            format!("http://{addr}")
        }
        Err(_) => format!("http://{listen}"),
    }
}

// ---------------------------------------------------------------------------
// The API client

/// A client of the daemon's HTTP API (docs/api.md), one method per route.
///
/// Answers are returned as the API's JSON, unchanged.
#[derive(Debug, Clone)]
pub struct Client {
    base: Url,
    token: Option<String>,
    http: reqwest::Client,
}

/// Why an API call failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The base URL is not usable.
    #[error("invalid daemon URL {url:?}: {reason}")]
    BadUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// No answer: refused connection, unknown host, timeout...
    #[error("cannot reach the daemon at {url}: {reason}")]
    Unreachable {
        /// The daemon's base URL.
        url: String,
        /// The transport's explanation.
        reason: String,
    },
    /// The server answered with an error status.
    #[error("{code}: {message}")]
    Api {
        /// The HTTP status.
        status: StatusCode,
        /// The API's error code, e.g. `id_reused`.
        code: String,
        /// The API's explanation.
        message: String,
    },
    /// The server answered something that is not the API's JSON.
    #[error("unexpected answer from {url}: {reason}")]
    BadResponse {
        /// The request's URL.
        url: String,
        /// What was wrong.
        reason: String,
    },
}

/// The body of `POST /v1/queues/{queue}/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct EnqueueRequest {
    /// The job's payload.
    pub payload: JsonText,
    /// A stable job id (deduplicates enqueues).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// A deduplication key, per queue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_key: Option<String>,
    /// How long the dedup key is held, e.g. `"10m"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_for: Option<String>,
    /// Delay before the first run, e.g. `"30s"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delay: Option<String>,
    /// Earliest run time, RFC 3339.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub run_at: Option<String>,
    /// Higher runs first.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// Overrides the queue's `max_attempts`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_attempts: Option<u32>,
}

/// The filters of `GET /v1/jobs`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobsQuery {
    /// Only jobs of this queue.
    pub queue: Option<String>,
    /// Only jobs in this state (`waiting`, `dead`...).
    pub state: Option<String>,
    /// Page size.
    pub limit: Option<u32>,
    /// The `next_cursor` of the previous page.
    pub cursor: Option<String>,
}

impl Client {
    /// A client of the daemon at `base` (`http://host:port`, optionally with
    /// a path prefix; a bare `host:port` means `http://host:port`).
    pub fn new(base: &str, token: Option<String>) -> Result<Self, ClientError> {
        let bad = |reason: String| ClientError::BadUrl {
            url: base.to_owned(),
            reason,
        };
        let with_scheme = if base.contains("://") {
            base.to_owned()
        } else {
            format!("http://{base}")
        };
        let url = Url::parse(&with_scheme).map_err(|err| bad(err.to_string()))?;
        if url.scheme() != "http" {
            return Err(bad(format!(
                "the scheme must be http, not {} (this client has no TLS)",
                url.scheme()
            )));
        }
        if url.host().is_none() {
            return Err(bad("no host".to_owned()));
        }
        crate::effects::http::install_crypto_provider();
        let http = reqwest::Client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .timeout(REQUEST_TIMEOUT)
            .user_agent(concat!("khata/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|err| bad(error_chain(&err)))?;
        Ok(Client {
            base: url,
            token: token.filter(|t| !t.is_empty()),
            http,
        })
    }

    /// The daemon's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// `GET /healthz`: `Ok` when the daemon answers.
    pub async fn health(&self) -> Result<(), ClientError> {
        self.call(Method::GET, &["healthz"], |r| r).await.map(drop)
    }

    /// `POST /v1/queues/{queue}/jobs`: `{job, deduplicated}`.
    pub async fn enqueue(
        &self,
        queue: &str,
        request: &EnqueueRequest,
    ) -> Result<Value, ClientError> {
        self.call(Method::POST, &["v1", "queues", queue, "jobs"], |r| {
            r.json(request)
        })
        .await
    }

    /// `POST /v1/queues/{queue}/jobs/batch`: `{results: [{job, deduplicated}]}`.
    pub async fn enqueue_batch(
        &self,
        queue: &str,
        requests: &[EnqueueRequest],
    ) -> Result<Value, ClientError> {
        let body = serde_json::json!({ "jobs": requests });
        self.call(
            Method::POST,
            &["v1", "queues", queue, "jobs", "batch"],
            |r| r.json(&body),
        )
        .await
    }

    /// `GET /v1/jobs/{id}`: the job with its attempts and effects.
    pub async fn job(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "jobs", id], |r| r).await
    }

    /// `GET /v1/jobs`: `{jobs, next_cursor}`.
    pub async fn jobs(&self, query: &JobsQuery) -> Result<Value, ClientError> {
        let mut params: Vec<(&str, String)> = Vec::new();
        if let Some(queue) = &query.queue {
            params.push(("queue", queue.clone()));
        }
        if let Some(state) = &query.state {
            params.push(("state", state.clone()));
        }
        if let Some(limit) = query.limit {
            params.push(("limit", limit.to_string()));
        }
        if let Some(cursor) = &query.cursor {
            params.push(("cursor", cursor.clone()));
        }
        self.call(Method::GET, &["v1", "jobs"], |r| r.query(&params))
            .await
    }

    /// `POST /v1/jobs/{id}/retry`: `{job}`.
    pub async fn retry(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::POST, &["v1", "jobs", id, "retry"], |r| {
            r.header(reqwest::header::CONTENT_TYPE, "application/json")
        })
        .await
    }

    /// `DELETE /v1/jobs/{id}`: `{job}`.
    pub async fn cancel(&self, id: &str) -> Result<Value, ClientError> {
        self.call(Method::DELETE, &["v1", "jobs", id], |r| r).await
    }

    /// `GET /v1/queues`: `{queues}`.
    pub async fn queues(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "queues"], |r| r).await
    }

    /// `GET /v1/schedules`: `{schedules}`.
    pub async fn schedules(&self) -> Result<Value, ClientError> {
        self.call(Method::GET, &["v1", "schedules"], |r| r).await
    }

    /// `GET /v1/fences`: `{fences}`.
    pub async fn fences(
        &self,
        namespace: Option<&str>,
        state: Option<&str>,
    ) -> Result<Value, ClientError> {
        let mut params: Vec<(&str, &str)> = Vec::new();
        if let Some(namespace) = namespace {
            params.push(("namespace", namespace));
        }
        if let Some(state) = state {
            params.push(("state", state));
        }
        self.call(Method::GET, &["v1", "fences"], |r| r.query(&params))
            .await
    }

    /// `POST /v1/fences/resolve`.
    pub async fn resolve_fence(
        &self,
        namespace: &str,
        kind: &str,
        key: &str,
        outcome: Resolution,
    ) -> Result<Value, ClientError> {
        let body = serde_json::json!({
            "namespace": namespace,
            "kind": kind,
            "key": key,
            "outcome": outcome.as_str(),
        });
        self.call(Method::POST, &["v1", "fences", "resolve"], |r| {
            r.json(&body)
        })
        .await
    }

    /// The URL of a route: the base URL's path, then `segments`, each
    /// percent-encoded.
    pub(super) fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        url.set_query(None);
        url.set_fragment(None);
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// Sends one request; returns the answer's JSON (`null` for an empty body).
    pub(super) async fn call(
        &self,
        method: Method,
        segments: &[&str],
        build: impl FnOnce(RequestBuilder) -> RequestBuilder,
    ) -> Result<Value, ClientError> {
        let url = self.url(segments);
        let mut request = build(self.http.request(method, url.clone()));
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let unreachable = |err: reqwest::Error| ClientError::Unreachable {
            url: self.base.as_str().trim_end_matches('/').to_owned(),
            reason: if err.is_timeout() {
                "no answer in time".to_owned()
            } else {
                root_cause(&err)
            },
        };
        let response = request.send().await.map_err(unreachable)?;
        let status = response.status();
        let body = response.bytes().await.map_err(unreachable)?;
        if !status.is_success() {
            return Err(api_error(status, &body));
        }
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).map_err(|err| ClientError::BadResponse {
            url: url.to_string(),
            reason: format!("not JSON: {err}"),
        })
    }
}

/// The error of a non-2xx answer: the API's `{error: {code, message}}`, or
/// the status and the start of whatever body came instead (a proxy's page).
pub(super) fn api_error(status: StatusCode, body: &[u8]) -> ClientError {
    #[derive(Deserialize)]
    struct Envelope {
        error: ErrorBody,
    }
    #[derive(Deserialize)]
    struct ErrorBody {
        code: String,
        #[serde(default)]
        message: String,
    }
    match serde_json::from_slice::<Envelope>(body) {
        Ok(Envelope { error }) => ClientError::Api {
            status,
            code: error.code,
            message: error.message,
        },
        Err(_) => {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            let message = if text.is_empty() {
                status.canonical_reason().unwrap_or("no message").to_owned()
            } else {
                let mut short: String = text.chars().take(200).collect();
                if short.len() < text.len() {
                    short.push('…');
                }
                short
            };
            ClientError::Api {
                status,
                code: format!("http_{}", status.as_u16()),
                message,
            }
        }
    }
}

/// The innermost explanation of an error ("Connection refused (os error
/// 111)"), which says more than reqwest's own "error sending request".
pub(super) fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut cause = err;
    while let Some(source) = cause.source() {
        cause = source;
    }
    cause.to_string()
}

/// An error with all its causes, `outer: inner: ...`.
pub(super) fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut text = err.to_string();
    let mut cause = err.source();
    while let Some(source) = cause {
        let _ = write!(text, ": {source}");
        cause = source.source();
    }
    text
}
