//! HTTP providers: the `[http.NAME]` sections of `jobs.toml` made into clients.
//!
//! This is the provider layer of the http effect (docs/fences.md and docs/jobs-toml.md#httpname), below the
//! fence protocol: it checks a handler's request, sends it to the provider's
//! host, reads the answer with a size cap and says, when no answer came,
//! whether the request may have reached the server. It keeps no state of its
//! own between calls and knows nothing of fences; the fence protocol calls
//! [`Provider::validate`], [`Provider::canonical`], [`Provider::send`] and
//! [`Provider::reconcile`].
//!
//! What a handler may do, and what stays in the host:
//!
//! - A handler names a provider and a *path*, never a URL. The URL is the
//!   provider's `base_url` with the path appended; a path that could leave
//!   the base (a scheme, `//host`, a `.` or `..` segment, also
//!   percent-encoded, a backslash, a fragment, control characters) is
//!   refused, and the joined URL is checked once more against the base
//!   (scheme, host, port and path prefix). Redirects are not followed: a
//!   `3xx` is the response.
//! - The provider's configured headers (secrets, resolved once when the
//!   providers are built), `Khata-Fencing-Token` and the idempotency header
//!   are set by the host; a handler may not set them, nor the headers that
//!   belong to the connection (`Host`, `Content-Length`, `Transfer-Encoding`,
//!   `Connection` and the other hop-by-hop headers).
//!
//! How a failure is classified ([`HttpError`]):
//!
//! - `Invalid`: the request is malformed; nothing was sent.
//! - `NotSent`: the connection was never established (DNS, refused, TLS
//!   handshake, a connect timeout): no byte of the request left the host, so
//!   sending again is safe. Each client's connect timeout is shorter than its
//!   total timeout so that a stalled connect is reported as a connect error.
//! - `Unknown`: anything after the connection was made and before a whole
//!   response was read (a timeout, a reset, a connection closed without an
//!   answer, a body that broke off). When in doubt, `Unknown`.
//! - `TooLarge`: a response was received but is larger than `max_response`.
//!
//! Any response that is read whole is `Ok`, whatever its status.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Once;
use std::time::Duration;

use base64::Engine as _;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Url};

use crate::config::{HttpProvider, Reconcile, Secret};

/// The header that carries the attempt's fencing token on every request.
const FENCING_TOKEN_HEADER: &str = "khata-fencing-token";

/// The methods a handler may use.
const METHODS: [&str; 6] = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"];

/// Headers that belong to the connection, not to the request: the host sets
/// them, a handler may not (lower case).
const CONNECTION_HEADERS: [&str; 9] = [
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "upgrade",
];

/// Idle pooled connections are closed after this long: shorter than common
/// server keep-alive timeouts, so that a request is rarely written to a
/// connection the server is closing (which would make its outcome unknown).
const POOL_IDLE: Duration = Duration::from_secs(4);

/// A request as a handler gives it (mirrors the WIT http.request, minus the provider name).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HttpRequest {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Vec<u8>>,
}

/// A received response; recorded in the fence and replayed verbatim.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    /// Serialized as a base64 string.
    #[serde(with = "base64_bytes")]
    pub body: Vec<u8>,
}

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum HttpError {
    /// Malformed request (method, path, header) — nothing sent.
    #[error("invalid: {0}")]
    Invalid(String),
    /// Nothing left the host (connect refused, DNS, TLS handshake failure): safe to send again.
    #[error("not sent: {0}")]
    NotSent(String),
    /// The request may have reached the server but no response came (timeout
    /// after connecting, connection reset while waiting, body read error):
    /// outcome unknown.
    #[error("outcome unknown: {0}")]
    Unknown(String),
    /// The response was larger than the provider's max_response.
    #[error("response too large: {0}")]
    TooLarge(String),
}

/// Every configured provider, by name.
#[derive(Default)]
pub struct Providers {
    providers: BTreeMap<String, Provider>,
}

impl fmt::Debug for Providers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.providers.iter()).finish()
    }
}

impl Providers {
    /// Builds one reqwest client per provider (timeout, no redirects — a
    /// redirect could leave the provider's host —, no proxy from env),
    /// resolving header secrets now (error names `http.NAME.headers.HEADER`
    /// and the env var or file).
    pub fn from_config(cfg: &BTreeMap<String, HttpProvider>) -> Result<Providers, String> {
        install_crypto_provider();
        let mut providers = BTreeMap::new();
        for (name, config) in cfg {
            providers.insert(name.clone(), Provider::build(name, config)?);
        }
        Ok(Providers { providers })
    }

    pub fn get(&self, name: &str) -> Option<&Provider> {
        self.providers.get(name)
    }

    /// The provider `name`, or the error that names the missing section.
    fn named(&self, name: &str) -> Result<&Provider, String> {
        self.get(name)
            .ok_or_else(|| format!("there is no [http.{name}] in jobs.toml"))
    }
}

#[async_trait::async_trait]
impl super::outside::HttpTransport for Providers {
    fn check(&self, provider: &str, request: &HttpRequest) -> Result<(), super::EffectError> {
        self.named(provider)
            .map_err(super::EffectError::Denied)?
            .validate(request)
            .map_err(|e| super::EffectError::Invalid(e.to_string()))
    }

    fn idempotent(&self, provider: &str) -> bool {
        self.get(provider).is_some_and(Provider::idempotent)
    }

    async fn send(
        &self,
        provider: &str,
        key: &str,
        fencing_token: u64,
        request: &HttpRequest,
    ) -> Result<HttpResponse, HttpError> {
        self.named(provider)
            .map_err(HttpError::Invalid)?
            .send(key, fencing_token, request)
            .await
    }

    async fn reconcile(
        &self,
        provider: &str,
        key: &str,
        fencing_token: u64,
    ) -> Option<Result<Option<HttpResponse>, HttpError>> {
        match self.named(provider) {
            Ok(p) => p.reconcile(key, fencing_token).await,
            Err(e) => Some(Err(HttpError::Invalid(e))),
        }
    }
}

/// One provider: its client, its resolved headers and its rules.
pub struct Provider {
    name: String,
    /// `base_url` without a trailing `/`: paths are appended to it.
    base_url: String,
    /// The same, parsed: the joined URL must keep its origin and path.
    base: Url,
    idempotency_header: Option<HeaderName>,
    /// Configured headers, values resolved and marked sensitive.
    headers: Vec<(HeaderName, HeaderValue)>,
    timeout: Duration,
    max_response: u64,
    reconcile: Option<Reconcile>,
    client: reqwest::Client,
}

impl fmt::Debug for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let header_names: Vec<&str> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("Provider")
            .field("name", &self.name)
            .field("base_url", &self.base_url)
            .field(
                "idempotency_header",
                &self.idempotency_header.as_ref().map(HeaderName::as_str),
            )
            .field("headers", &header_names)
            .field("timeout", &self.timeout)
            .field("max_response", &self.max_response)
            .field("reconcile", &self.reconcile)
            .finish_non_exhaustive()
    }
}

/// The checks of [`Provider::validate`] that do not depend on a provider:
/// method, path, and header names and values (no connection header, no
/// `Khata-Fencing-Token`). Returns the parsed method and headers.
pub fn check_request(req: &HttpRequest) -> Result<(Method, HeaderMap), HttpError> {
    if !METHODS.contains(&req.method.as_str()) {
        return Err(HttpError::Invalid(format!(
            "method: {:?} is not one of {}",
            req.method,
            METHODS.join(", ")
        )));
    }
    let method = Method::from_bytes(req.method.as_bytes())
        .map_err(|_| HttpError::Invalid(format!("method: {:?}", req.method)))?;
    check_path(&req.path).map_err(|e| HttpError::Invalid(format!("path: {e}")))?;
    let mut headers = HeaderMap::with_capacity(req.headers.len());
    for (i, (name, value)) in req.headers.iter().enumerate() {
        let invalid = |why: &str| HttpError::Invalid(format!("headers[{i}] {name:?}: {why}"));
        let header_name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid("not a valid header name"))?;
        let lower = header_name.as_str();
        if CONNECTION_HEADERS.contains(&lower) {
            return Err(invalid("belongs to the connection; the host sets it"));
        }
        if lower == FENCING_TOKEN_HEADER {
            return Err(invalid("the host sets it to the attempt's fencing token"));
        }
        let header_value = HeaderValue::from_str(value)
            .map_err(|_| invalid("the value is not a valid header value (control characters?)"))?;
        headers.append(header_name, header_value);
    }
    Ok((method, headers))
}

/// The canonical form of a request to provider `name`, used for the fence
/// fingerprint: see [`Provider::canonical`].
pub fn canonical(name: &str, req: &HttpRequest) -> Vec<u8> {
    #[derive(serde::Serialize)]
    struct Canonical<'a> {
        provider: &'a str,
        method: &'a str,
        path: &'a str,
        headers: Vec<(String, &'a str)>,
        body: Option<String>,
    }
    let mut headers: Vec<(String, &str)> = req
        .headers
        .iter()
        .map(|(name, value)| (name.to_ascii_lowercase(), value.as_str()))
        .collect();
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    let canonical = Canonical {
        provider: name,
        method: &req.method,
        path: &req.path,
        headers,
        body: req
            .body
            .as_ref()
            .map(|body| base64::engine::general_purpose::STANDARD.encode(body)),
    };
    serde_json::to_vec(&canonical).expect("a struct of strings serializes")
}

impl Provider {
    fn build(name: &str, config: &HttpProvider) -> Result<Provider, String> {
        let key = format!("http.{name}");
        let base_url = config.base_url.trim().trim_end_matches('/').to_owned();
        let base = parse_base_url(&base_url).map_err(|e| format!("{key}.base_url: {e}"))?;

        let idempotency_header = match &config.idempotency_header {
            Some(header) => Some(HeaderName::from_bytes(header.as_bytes()).map_err(|_| {
                format!("{key}.idempotency_header: {header:?} is not a valid header name")
            })?),
            None => None,
        };

        let mut headers = Vec::with_capacity(config.headers.len());
        for (header, secret) in &config.headers {
            let at = format!("{key}.headers.{header}");
            let header_name = HeaderName::from_bytes(header.as_bytes())
                .map_err(|_| format!("{at}: {header:?} is not a valid header name"))?;
            let lower = header_name.as_str();
            if CONNECTION_HEADERS.contains(&lower) || lower == FENCING_TOKEN_HEADER {
                return Err(format!(
                    "{at}: {header} is set by khata and cannot be configured"
                ));
            }
            if idempotency_header.as_ref() == Some(&header_name) {
                return Err(format!(
                    "{at}: {header} is the idempotency header; khata sets it to the effect's key"
                ));
            }
            let value = secret.resolve().map_err(|e| format!("{at}: {e}"))?;
            let mut value = HeaderValue::from_str(&value).map_err(|_| {
                format!(
                    "{at}: the value ({}) is not a valid header value",
                    secret_source(secret)
                )
            })?;
            value.set_sensitive(true);
            headers.push((header_name, value));
        }

        if let Some(reconcile) = &config.reconcile {
            if !METHODS.contains(&reconcile.method.as_str()) {
                return Err(format!(
                    "{key}.reconcile.method: {:?} is not one of {}",
                    reconcile.method,
                    METHODS.join(", ")
                ));
            }
            check_path(&reconcile.path.replace("{key}", "k"))
                .map_err(|e| format!("{key}.reconcile.path: {e}"))?;
        }

        let client = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(connect_timeout(config.timeout))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .retry(reqwest::retry::never())
            .pool_idle_timeout(POOL_IDLE)
            .build()
            .map_err(|e| format!("{key}: cannot build an HTTP client: {}", describe(e)))?;

        Ok(Provider {
            name: name.to_owned(),
            base_url,
            base,
            idempotency_header,
            headers,
            timeout: config.timeout,
            max_response: config.max_response,
            reconcile: config.reconcile.clone(),
            client,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// True when the provider deduplicates by key (an idempotency_header is configured).
    pub fn idempotent(&self) -> bool {
        self.idempotency_header.is_some()
    }

    /// Checks a request without sending: method is one of GET HEAD POST PUT
    /// PATCH DELETE; path starts with '/', has no scheme, no authority
    /// ("//host"), no '..' segment (also percent-encoded), no CR/LF, no '#';
    /// header names/values valid; the guest may not set Host,
    /// Content-Length, Transfer-Encoding, Connection, Khata-Fencing-Token,
    /// the provider's idempotency header, nor any header configured for the
    /// provider (secrets stay in the host). Error names the field: `path:
    /// ...`, `headers[2] "Host": ...`.
    pub fn validate(&self, req: &HttpRequest) -> Result<(), HttpError> {
        self.checked_headers(req).map(|_| ())
    }

    /// The canonical form of the request used for the fence fingerprint:
    /// method, path, sorted headers (names lower-cased), body — as bytes (e.g.
    /// serde_json of a canonical struct).
    ///
    /// The provider's name is part of it, so that one key used with two
    /// providers is two different requests. Headers are sorted by name with
    /// a stable sort: values of a repeated header keep their order, which is
    /// meaningful.
    pub fn canonical(&self, req: &HttpRequest) -> Vec<u8> {
        canonical(&self.name, req)
    }

    /// Sends: URL = base_url joined with path (string concatenation of
    /// base_url without trailing '/' and path; then assert the resulting
    /// URL's scheme/host/port equal base_url's), configured headers,
    /// `Khata-Fencing-Token: <token>`, and `<idempotency_header>: <key>` when
    /// configured. Reads the whole response up to max_response bytes
    /// (streaming with a cap, not buffering unbounded). Any received status
    /// is Ok (a 500 is a response).
    pub async fn send(
        &self,
        key: &str,
        fencing_token: u64,
        req: &HttpRequest,
    ) -> Result<HttpResponse, HttpError> {
        let (method, mut headers) = self.checked_headers(req)?;
        let url = self
            .url_for(&req.path)
            .map_err(|e| HttpError::Invalid(format!("path: {e}")))?;
        self.add_host_headers(&mut headers, fencing_token);
        if let Some(header) = &self.idempotency_header {
            let value = HeaderValue::from_str(key).map_err(|_| {
                HttpError::Invalid(format!(
                    "key: {key:?} cannot be sent in the {header} header"
                ))
            })?;
            headers.insert(header.clone(), value);
        }
        let mut request = reqwest::Request::new(method, url);
        *request.headers_mut() = headers;
        if let Some(body) = &req.body {
            *request.body_mut() = Some(body.clone().into());
        }
        tracing::debug!(provider = %self.name, method = %req.method, path = %req.path, "http send");
        let response = self.execute(request).await;
        match &response {
            Ok(r) => tracing::debug!(provider = %self.name, status = r.status, "http response"),
            Err(e) => tracing::debug!(provider = %self.name, error = %e, "http send failed"),
        }
        response
    }

    /// (docs/fences.md#unknown-outcomes): None when no `reconcile` is configured.
    /// Otherwise sends reconcile.method to reconcile.path with `{key}`
    /// replaced by the percent-encoded key (plus configured headers and the
    /// fencing token): Some(Ok(Some(resp))) for a 2xx (the effect happened;
    /// resp is recorded as its result), Some(Ok(None)) for 404 (it did not
    /// happen), Some(Err(..)) for anything else (still unknown).
    pub async fn reconcile(
        &self,
        key: &str,
        fencing_token: u64,
    ) -> Option<Result<Option<HttpResponse>, HttpError>> {
        let reconcile = self.reconcile.as_ref()?;
        Some(self.reconcile_with(reconcile, key, fencing_token).await)
    }

    async fn reconcile_with(
        &self,
        reconcile: &Reconcile,
        key: &str,
        fencing_token: u64,
    ) -> Result<Option<HttpResponse>, HttpError> {
        let path = reconcile.path.replace("{key}", &percent_encode(key));
        check_path(&path).map_err(|e| HttpError::Invalid(format!("reconcile path: {e}")))?;
        let url = self
            .url_for(&path)
            .map_err(|e| HttpError::Invalid(format!("reconcile path: {e}")))?;
        let method = Method::from_bytes(reconcile.method.as_bytes())
            .map_err(|_| HttpError::Invalid(format!("reconcile method: {:?}", reconcile.method)))?;
        let mut headers = HeaderMap::new();
        self.add_host_headers(&mut headers, fencing_token);
        let mut request = reqwest::Request::new(method, url);
        *request.headers_mut() = headers;
        let response = self.execute(request).await?;
        tracing::debug!(provider = %self.name, status = response.status, "http reconcile");
        match response.status {
            200..=299 => Ok(Some(response)),
            404 => Ok(None),
            status => Err(HttpError::Unknown(format!(
                "reconciliation answered {status}, neither 2xx nor 404"
            ))),
        }
    }

    /// Validates a request and returns its method and its headers, ready to send.
    fn checked_headers(&self, req: &HttpRequest) -> Result<(Method, HeaderMap), HttpError> {
        let (method, headers) = check_request(req)?;
        for (i, (name, _)) in req.headers.iter().enumerate() {
            let invalid = |why: &str| HttpError::Invalid(format!("headers[{i}] {name:?}: {why}"));
            // check_request has parsed every name.
            let Ok(header_name) = HeaderName::from_bytes(name.as_bytes()) else {
                continue;
            };
            if self.idempotency_header.as_ref() == Some(&header_name) {
                return Err(invalid(
                    "the provider's idempotency header; the host sets it to the effect's key",
                ));
            }
            if self.headers.iter().any(|(n, _)| *n == header_name) {
                return Err(invalid("configured for the provider; the host sets it"));
            }
        }
        Ok((method, headers))
    }

    /// The provider's configured headers and the fencing token.
    fn add_host_headers(&self, headers: &mut HeaderMap, fencing_token: u64) {
        for (name, value) in &self.headers {
            headers.insert(name.clone(), value.clone());
        }
        headers.insert(
            HeaderName::from_static(FENCING_TOKEN_HEADER),
            HeaderValue::from(fencing_token),
        );
    }

    /// `base_url` + `path`, checked to stay under the base: same scheme,
    /// host, port and credentials, and a path under the base's path.
    fn url_for(&self, path: &str) -> Result<Url, String> {
        let url = Url::parse(&format!("{}{path}", self.base_url))
            .map_err(|e| format!("{path:?} does not make a valid URL: {e}"))?;
        let base = &self.base;
        let same_origin = url.scheme() == base.scheme()
            && url.host_str() == base.host_str()
            && url.port_or_known_default() == base.port_or_known_default()
            && url.username() == base.username()
            && url.password() == base.password()
            && url.fragment().is_none();
        let base_path = base.path().trim_end_matches('/');
        let under_base = base_path.is_empty()
            || url.path() == base_path
            || url
                .path()
                .strip_prefix(base_path)
                .is_some_and(|rest| rest.starts_with('/'));
        if same_origin && under_base {
            Ok(url)
        } else {
            Err(format!("{path:?} leads outside the provider's base_url"))
        }
    }

    /// Sends a checked request and reads the whole response, up to `max_response`.
    async fn execute(&self, request: reqwest::Request) -> Result<HttpResponse, HttpError> {
        let mut response = self.client.execute(request).await.map_err(classify)?;
        let status = response.status().as_u16();
        let headers = response
            .headers()
            .iter()
            .map(|(name, value)| {
                (
                    name.as_str().to_owned(),
                    String::from_utf8_lossy(value.as_bytes()).into_owned(),
                )
            })
            .collect();
        let max = self.max_response;
        let too_large = |what: String| {
            HttpError::TooLarge(format!(
                "status {status}, {what}; the limit of provider {} is {max} bytes",
                self.name
            ))
        };
        if let Some(length) = response.content_length()
            && length > max
        {
            return Err(too_large(format!("a body of {length} bytes")));
        }
        let capacity = response.content_length().unwrap_or(0).min(max);
        let mut body = Vec::with_capacity(usize::try_from(capacity).unwrap_or(0));
        loop {
            let chunk = response.chunk().await.map_err(|e| {
                HttpError::Unknown(format!(
                    "status {status} received, then reading the body failed: {}",
                    describe(e)
                ))
            })?;
            let Some(chunk) = chunk else { break };
            let total = (body.len() as u64).saturating_add(chunk.len() as u64);
            if total > max {
                return Err(too_large(format!("more than {max} bytes of body")));
            }
            body.extend_from_slice(&chunk);
        }
        Ok(HttpResponse {
            status,
            headers,
            body,
        })
    }
}

/// Installs ring as the process's rustls crypto provider, once: reqwest is
/// built with `rustls-no-provider` and takes the installed default when a
/// client is built (and panics if there is none).
pub fn install_crypto_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // An error means some other part of the process installed one first: fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// The connect phase gets three quarters of the total timeout, so that a
/// stalled connect ends as a connect error (nothing sent) rather than as the
/// total timeout (outcome unknown).
fn connect_timeout(total: Duration) -> Duration {
    (total * 3 / 4).max(Duration::from_millis(1))
}

/// Classifies a transport error of `execute` (see the module doc).
fn classify(e: reqwest::Error) -> HttpError {
    let (connect, builder) = (e.is_connect(), e.is_builder());
    let text = describe(e);
    if connect {
        // DNS, refused, unreachable, TLS handshake, connect timeout: the
        // request itself was never written.
        HttpError::NotSent(text)
    } else if builder {
        // The request could not be turned into one to send: nothing left.
        HttpError::NotSent(text)
    } else {
        // A timeout after connecting, a reset, a connection closed before
        // the answer, a protocol error: the request may have arrived.
        HttpError::Unknown(text)
    }
}

/// An error with its causes, without the URL (the path is the handler's).
fn describe(e: reqwest::Error) -> String {
    use std::error::Error as _;
    let timed_out = e.is_timeout();
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    if timed_out && !text.contains("timed out") {
        text.push_str(" (timed out)");
    }
    text
}

/// Where a secret came from, for error messages (never its value).
fn secret_source(secret: &Secret) -> String {
    match secret {
        Secret::Plain(_) => "inline".to_owned(),
        Secret::Env { var, .. } => format!("from environment variable {var}"),
        Secret::File { path, .. } => format!("from file {}", path.display()),
    }
}

/// Parses and checks a provider's `base_url`.
fn parse_base_url(base_url: &str) -> Result<Url, String> {
    let url = Url::parse(base_url).map_err(|e| format!("{base_url:?} is not a URL: {e}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!("{base_url:?} is not an http:// or https:// URL"));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(format!("{base_url:?} has no host"));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(format!(
            "{base_url:?} carries credentials; put them in `headers`"
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(format!(
            "{base_url:?} has a query or fragment; paths are appended to it"
        ));
    }
    Ok(url)
}

/// Checks a path given by a handler (or a reconcile path with its key).
fn check_path(path: &str) -> Result<(), String> {
    if !path.starts_with('/') {
        return Err(format!(
            "{path:?} must start with '/' (a path under the provider's base_url, not a URL)"
        ));
    }
    if path.starts_with("//") {
        return Err(format!(
            "{path:?} must not start with \"//\" (it would name a host)"
        ));
    }
    if path.contains(['\r', '\n']) {
        return Err(format!("{path:?} must not contain CR or LF"));
    }
    if path.chars().any(char::is_control) {
        return Err(format!("{path:?} must not contain control characters"));
    }
    if path.contains('#') {
        return Err(format!("{path:?} must not contain a fragment ('#')"));
    }
    if path.contains('\\') {
        return Err(format!("{path:?} must not contain '\\'"));
    }
    let path_part = path.split('?').next().unwrap_or("");
    for segment in path_part.split('/') {
        let decoded = percent_decode_fully(segment.as_bytes());
        let dots = decoded
            .split(|&b| b == b'/' || b == b'\\')
            .any(|piece| piece == b".." || piece == b".");
        if dots {
            return Err(format!(
                "{path:?} must not contain a '.' or '..' segment (also percent-encoded)"
            ));
        }
    }
    Ok(())
}

/// Percent-decodes until nothing changes (a few rounds at most), so that a
/// double-encoded `..` is found too.
fn percent_decode_fully(bytes: &[u8]) -> Vec<u8> {
    let mut current = bytes.to_vec();
    for _ in 0..4 {
        let next = percent_decode(&current);
        if next == current {
            break;
        }
        current = next;
    }
    current
}

fn percent_decode(bytes: &[u8]) -> Vec<u8> {
    fn hex(b: u8) -> Option<u8> {
        match b {
            b'0'..=b'9' => Some(b - b'0'),
            b'a'..=b'f' => Some(b - b'a' + 10),
            b'A'..=b'F' => Some(b - b'A' + 10),
            _ => None,
        }
    }
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                bytes.get(i + 1).copied().and_then(hex),
                bytes.get(i + 2).copied().and_then(hex),
            )
        {
            out.push((hi << 4) | lo);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    out
}

/// Percent-encodes every byte but the unreserved characters of RFC 3986.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `serde(with)` for a body as a base64 string.
mod base64_bytes {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        STANDARD.decode(text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests;
